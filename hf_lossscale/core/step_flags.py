"""The iteration's flags on the device: the loss probe (a non-finite loss is a forward overflow)
and the found-inf flag, side by side in one persistent buffer `[found, probe, 1]` so `update()` reads
both with one compare. A mixin of `DynamicLossScaler`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    pass


class StepFlags:
    """The flags buffer and the loss probe of `DynamicLossScaler` (see the module docstring)."""

    def _note_loss(self, factor: torch.Tensor) -> None:
        """Keep a device probe of the losses (no host sync) from a scaled loss's factor (`scale + loss * 0`,
        NaN exactly when the loss is non-finite): `factor * 0` is 0 or NaN. A non-finite loss is a forward
        overflow, which no scale can fix: `update()` counts it where the step was skipped. A 1-element
        factor on the scale's device writes the probe into the flags buffer (`_flag_views`), so `update()`
        reads it with the found-inf flag in one compare. The probe never decides a skip by itself: the
        loss's own poisoned gradients do (a `zero_grad()` that drops them drops the skip)."""
        factor = factor.detach()
        if factor.device == self._scale.device and factor.numel() == 1:
            _, _, in_buffer = self._flag_views(factor.device)
            if self._loss_probe is None:  # the iteration's first loss
                torch.mul(factor.reshape(()), 0, out=in_buffer)
                self._loss_probe = in_buffer
                return
            if self._loss_probe is in_buffer:  # more losses (accumulation): added in place, still one op
                self._loss_probe.add_(factor.reshape(()), alpha=0)
                return
        probe = factor.mul(0)
        if probe.numel() != 1:
            probe = probe.sum()
        probe = probe.reshape(()).to(self._scale.device, non_blocking=True)
        self._loss_probe = probe if self._loss_probe is None else self._loss_probe + probe

    def _flag_views(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The flags buffer on `device` (made once) and its first two elements as 0-d views:
        [found-inf flag, loss probe, 1.0]. The first optimizer's check on the scale's device writes
        its flag into it, the first loss its probe, so that `update()` reads both with one compare of
        the buffer (no stack of 0-d tensors). The views are made once: code that traces the scaler
        sees the same tensors at every step."""
        views = self._flags.get(device)
        if views is None:
            buffer = torch.zeros(3, device=device)  # made on the device: no copy from the host
            buffer[2].fill_(1.0)
            views = self._flags[device] = (buffer, buffer[0], buffer[1])
        return views

    def _new_found(self, device: torch.device) -> torch.Tensor:
        """A zero found-inf flag on `device`: the flags buffer's, for the iteration's first check on the
        scale's device, else a fresh one. One op either way."""
        if device == self._scale.device and not self._found_taken:
            self._found_taken = True
            return self._flag_views(device)[1].zero_()
        return torch.zeros((), dtype=torch.float32, device=device)

    @property
    def loss_finite_tensor(self) -> torch.Tensor | None:
        """A 0-d bool device flag: were all losses `scale()` saw since the last `update()` finite?
        None before the first `scale()` of the iteration. No sync (one device op when asked)."""
        return None if self._loss_probe is None else self._loss_probe.eq(0)

    def _one(self, device: torch.device) -> torch.Tensor:
        """A 1.0 on `device` (a fused step's divisor, the check's unit scale), made once."""
        return self._constants(device).one
