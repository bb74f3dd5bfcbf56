"""`StepFlags`: one iteration's flags on the device. The loss probe (a non-finite loss is a forward
overflow) and the first found-inf flag on the scale's device sit side by side in one persistent
buffer `[found, probe, 1]`, so `update()` reads both with one compare. The scaler holds one and calls
`new_iteration()` at each `update()`; every method takes the scale's device (`home`) explicitly.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StepFlags"]


class StepFlags:
    """The flags buffer (one per device, made once) and the iteration's loss probe.

    Example:

    ```python
    >>> import torch
    >>> from hf_lossscale.core.step_flags import StepFlags
    >>> flags, cpu = StepFlags(), torch.device("cpu")
    >>> flags.note_loss(torch.tensor(float("inf")), cpu)  # a scaled loss's factor
    >>> bool(flags.loss_finite())
    False
    >>> flags.new_iteration()
    >>> flags.loss_finite() is None
    True
    ```
    """

    def __init__(self) -> None:
        self._buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        #: 0-d device tensor: the sum of `loss * 0` over the losses `scale()` saw since the last
        #: `update()`: 0 when all were finite, NaN otherwise (inf * 0 is NaN); None when none was seen.
        #: The overflow check reads it together with the gradients, in the same kernel call.
        self.probe: torch.Tensor | None = None
        self._found_taken = False  # whether this iteration's check used the buffer's flag (new_found)

    def new_iteration(self) -> torch.Tensor | None:
        """Close the iteration: return its probe, and free the buffer's flag for the next one's check."""
        probe, self.probe = self.probe, None
        self._found_taken = False
        return probe

    def views(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The flags buffer on `device` (made once) and its first two elements as 0-d views:
        [found-inf flag, loss probe, 1.0]. The first optimizer's check on the scale's device writes its
        flag into it, the first loss its probe, so that `update()` reads both with one compare of the
        buffer (no stack of 0-d tensors). The views are made once: code that traces the scaler sees
        the same tensors at every step."""
        views = self._buffers.get(device)
        if views is None:
            buffer = torch.zeros(3, device=device)  # made on the device: no copy from the host
            buffer[2].fill_(1.0)
            views = self._buffers[device] = (buffer, buffer[0], buffer[1])
        return views

    def note_loss(self, factor: torch.Tensor, home: torch.device) -> None:
        """Keep a device probe of the losses (no host sync) from a scaled loss's factor (`scale + loss
        * 0`, NaN exactly when the loss is non-finite): `factor * 0` is 0 or NaN. A non-finite loss is
        a forward overflow, which no scale can fix: `update()` counts it where the step was skipped.
        A 1-element factor on the scale's device (`home`) writes the probe into the flags buffer, so
        `update()` reads it with the found-inf flag in one compare. The probe never decides a skip by
        itself: the loss's own poisoned gradients do (a `zero_grad()` that drops them drops the skip)."""
        factor = factor.detach()
        if factor.device == home and factor.numel() == 1:
            _, _, in_buffer = self.views(factor.device)
            if self.probe is None:  # the iteration's first loss
                torch.mul(factor.reshape(()), 0, out=in_buffer)
                self.probe = in_buffer
                return
            if self.probe is in_buffer:  # more losses (accumulation): added in place, still one op
                self.probe.add_(factor.reshape(()), alpha=0)
                return
        probe = factor.mul(0)
        if probe.numel() != 1:
            probe = probe.sum()
        probe = probe.reshape(()).to(home, non_blocking=True)
        self.probe = probe if self.probe is None else self.probe + probe

    def new_found(self, device: torch.device, home: torch.device) -> torch.Tensor:
        """A zero found-inf flag on `device`: the flags buffer's, for the iteration's first check on
        the scale's device (`home`), else a fresh one. One op either way."""
        if device == home and not self._found_taken:
            self._found_taken = True
            return self.views(device)[1].zero_()
        return torch.zeros((), dtype=torch.float32, device=device)

    def loss_finite(self) -> torch.Tensor | None:
        """A 0-d bool device flag: were all losses noted this iteration finite? None before the first.
        No sync (one device op when asked)."""
        return None if self.probe is None else self.probe.eq(0)

    def __getstate__(self) -> dict[str, Any]:
        # Buffers made again on first use: pickled, the buffer's views would come back as copies of
        # their own (an optimizer's overflow written where update() no longer reads it).
        return {**self.__dict__, "_buffers": {}, "_found_taken": False}
