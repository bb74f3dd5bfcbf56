"""The update rule on device tensors: what `update()` does to the scale, the trackers and the
counters, given the iteration's flags. A mixin of `DynamicLossScaler` (it reads `self.config` and
`self.state`); one module a reader takes in at one sitting:

- `_apply_rule`, the general rule, from the flags on the device (no host read);
- `_apply_known_rule`, the same for a step whose skip the host already knows (constants stand in
  for the flags);
- `_torch_rule_applies`, when torch's own `_amp_update_scale_` kernel computes the config's rule;
- `_constants`, the device constants both use (made once per device).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .config import SCALE_MAX

if TYPE_CHECKING:
    from .config import LossScaleConfig
    from .scaler_state import ScalerState


class RuleConstants(NamedTuple):
    """The scaler's device constants (`DynamicLossScaler._constants`): a 1.0 (`_one`) and the update
    rule's. The counters' factors are
    [K, A] rows (counters * K + A, see `_apply_rule`): `index` picks them from the flags [skipped,
    loss non-finite, True]; `clean`, `skip_ok` and `skip_bad` are them for a step the host knows was
    clean, skipped with a finite loss, skipped with a non-finite one."""

    index: torch.Tensor
    one: torch.Tensor
    false: torch.Tensor
    true: torch.Tensor
    zero: torch.Tensor
    clean: torch.Tensor
    skip_ok: torch.Tensor
    skip_bad: torch.Tensor


def world_size(group: Any = None) -> int:
    """The number of ranks in `group` (the world by default); 1 without an initialised process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _power_of_two(x: float) -> bool:
    mantissa, _ = math.frexp(x)
    return x > 0 and mantissa == 0.5


class UpdateRule:
    """The update rule of `DynamicLossScaler` (see the module docstring)."""

    config: LossScaleConfig
    state: ScalerState

    def _clamp_growth_tracker(self) -> None:
        """Keep the growth streak below the interval (a streak at or past a lowered interval grows at
        the next clean step either way; torch's kernel needs it below, see `_torch_rule_applies`)."""
        top = self.config.growth_interval - 1
        if self.state.materialised:
            self.state["_growth_tracker"].clamp_(max=top)
        else:
            self.state.host["_growth_tracker"] = min(self.state.host["_growth_tracker"], top)

    def _all_ranks_loss_flag(self, loss_bad: torch.Tensor | None) -> torch.Tensor:
        """Whether any rank's loss was non-finite: one 1-element all-reduce (MAX) on the device, no host
        sync. Under DDP one rank's non-finite loss makes every rank's gradients non-finite; without
        this, that rank would spare the scale while the others back off, and the replicas' scales (and
        later their skips) would drift apart. Every rank takes part, with 0 when it saw no loss."""
        import torch.distributed as dist

        if loss_bad is None:
            flag = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        else:
            flag = loss_bad.to(torch.float32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._found_inf_group)
        return flag > 0

    def _apply_rule(
        self, found: torch.Tensor, loss_bad: torch.Tensor | None = None, bits: torch.Tensor | None = None
    ) -> None:
        """The update rule on the device tensors; `found` is a 0-d bool tensor (the step was skipped),
        `loss_bad` whether a loss of the iteration was non-finite (None: no loss was seen); `bits`, when
        the caller has it, the bool vector [found, loss_bad, True].

        A skip whose loss was non-finite is a forward overflow: unless `backoff_on_nonfinite_loss`,
        it leaves the scale and the trackers as they were (no scale can fix it).

        Device ops are kept few (each is a kernel launch on a GPU): the five counters advance together
        (`ScalerState.counters`: x K + A, with K and A picked from the step's flags in one index op),
        and where the rule is torch's (`_torch_rule_applies`) the scale and growth tracker move with
        torch's own `_amp_update_scale_` kernel and one clamp.
        """
        c, s = self.config, self.state
        bad = loss_bad if loss_bad is not None else torch.zeros_like(found)
        # flags = [skipped, loss non-finite, 1]; K = flags[[0, 1, 2, 2, 2]], A = flags[[0, 1, 2, 0, 1]]:
        # consecutive = (consecutive + 1) * flag, total += 1, skipped += flag, nonfinite += flag
        k = self._constants(found.device)
        if bits is None:
            bits = torch.stack([found, bad, k.true])
        factors = bits[k.index]  # bool: multiplying and adding them into the int64 counters promotes
        torch.addcmul(factors[1], s.counters, factors[0], out=s.counters)  # counters * K + A, one op
        s.replace("last_step_skipped", found)  # a fresh tensor each update: holders keep a snapshot
        self.last_loss_nonfinite = loss_bad
        self._backed_off = None
        if c.mode != "dynamic":
            return
        neutral = None if loss_bad is None or c.backoff_on_nonfinite_loss else loss_bad
        if self._torch_rule_applies():
            # the backoff decision: a skip that is not a forward overflow (skipped > loss non-finite)
            overflow = torch.gt(bits[0], bits[1], out=self._overflow_buffer()) if neutral is not None else (
                found.to(torch.float32))  # fmt: skip
            if neutral is not None:  # a forward overflow neither advances nor resets the growth streak:
                # (the kernel's +1 for a clean step brings it back)
                s["_growth_tracker"].add_(bits[1], alpha=-1)
            torch._amp_update_scale_(
                s["scale"],
                s["_growth_tracker"],
                overflow,
                c.growth_factor,
                c.backoff_factor,
                c.growth_interval,
            )
            s["scale"].clamp_(c.min_scale, c.max_scale)
            self._backed_off = overflow
            return
        scale, growth, hyst = s["scale"], s["_growth_tracker"], s["_hysteresis_tracker"]
        overflow = found if neutral is None else found & ~neutral
        growth_after = torch.where(overflow, 0, growth + 1)
        if neutral is not None:  # a forward overflow neither resets nor advances the growth streak
            growth_after = torch.where(neutral, growth, growth_after)
        grow = growth_after >= c.growth_interval
        if c.hysteresis == 1:  # a budget of one: every overflow backs off, the tracker stays full
            back_off = overflow
        else:
            hyst_after_overflow = (hyst - 1).clamp_(min=0)
            back_off = overflow & (hyst_after_overflow == 0)
        self._backed_off = back_off
        # Compute in float64 and round once, as torch's _amp_update_scale_ kernels do.
        grown = (scale.double() * c.growth_factor).clamp_(max=c.max_scale).float()
        backed = (scale.double() * c.backoff_factor).clamp_(min=c.min_scale).float()
        scale.copy_(torch.where(back_off, backed, torch.where(grow, grown, scale)))
        growth.copy_(torch.where(grow, 0, growth_after))
        if c.hysteresis > 1:
            refill = grow | (~found) if c.consecutive_hysteresis else grow
            hyst.copy_(torch.where(overflow, hyst_after_overflow, torch.where(refill, c.hysteresis, hyst)))

    def _apply_known_rule(self, device: torch.device, skipped: bool, probe: torch.Tensor | None) -> None:
        """`_apply_rule` for a step whose skip the host already knows (the non-fused path reads the
        flag), where the rule is torch's: constants stand in for the flags. A clean step had a finite
        loss (the probe joined the check): fixed counters' factors (streaks end, one more step) and a
        zero backoff flag, three ops (static mode: one). A skipped one: only whether its loss was
        non-finite comes from the device (the probe: 0 or NaN); it picks one of two factor pairs (K, A
        for [1, b, 1]: see `_apply_rule`) and, where such a skip is neutral, clears the backoff flag:
        seven ops with a probe (the general branch: eight), three without."""
        c, s, k = self.config, self.state, self._constants(device)
        if not skipped:
            loss_bad, factors, overflow = (k.false if probe is not None else None), k.clean, k.zero
        else:
            loss_bad = None if probe is None else probe.ne(0)
            factors = k.skip_ok if loss_bad is None else torch.where(loss_bad, k.skip_bad, k.skip_ok)
            overflow = self._one(device)
        torch.addcmul(factors[1], s.counters, factors[0], out=s.counters)
        s.replace("last_step_skipped", k.true if skipped else k.false)  # constants nobody writes to
        self.last_loss_nonfinite = loss_bad
        self._backed_off = None
        if c.mode != "dynamic":
            return
        if skipped and loss_bad is not None and not c.backoff_on_nonfinite_loss:  # a neutral skip
            overflow = torch.eq(loss_bad, False, out=self._overflow_buffer())
            s["_growth_tracker"].add_(loss_bad, alpha=-1)  # (the kernel's +1 for "no overflow" undone)
        torch._amp_update_scale_(
            s["scale"], s["_growth_tracker"], overflow, c.growth_factor, c.backoff_factor, c.growth_interval
        )
        s["scale"].clamp_(c.min_scale, c.max_scale)
        self._backed_off = overflow if skipped else k.false

    def _constants(self, device: torch.device) -> RuleConstants:
        """The scaler's constants on `device`, made once (at the first step that needs one)."""
        found = self._rule_constants.get(device)
        if found is None:

            def tensor(value, dtype=None):
                return torch.tensor(value, dtype=dtype, device=device)

            found = self._rule_constants[device] = RuleConstants(
                index=tensor([[0, 1, 2, 2, 2], [0, 1, 2, 0, 1]]),
                one=tensor(1.0, torch.float32),
                false=tensor(False),
                true=tensor(True),
                zero=tensor(0.0, torch.float32),
                clean=tensor([[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]),
                skip_ok=tensor([[1, 0, 1, 1, 1], [1, 0, 1, 1, 0]]),
                skip_bad=tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]),
            )
        return found

    def _overflow_buffer(self) -> torch.Tensor:
        return torch.empty((), dtype=torch.float32, device=self._scale.device)

    def _torch_rule_applies(self) -> bool:
        """Whether torch's `_amp_update_scale_` kernel computes this config's rule exactly: no hysteresis
        (a budget of one overflow: every overflow backs off, the tracker stays full), power-of-two
        factors (exact in FP32 as in FP64), and a ceiling whose growth stays finite in FP32 (the kernel
        keeps a scale whose growth overflows; ours clamps to the ceiling, which is then the same). The
        growth tracker is kept below the interval (`_clamp_growth_tracker`), since the kernel grows
        only when the streak *equals* the interval."""
        c = self.config
        return (
            c.hysteresis == 1
            and _power_of_two(c.growth_factor)
            and _power_of_two(c.backoff_factor)
            and c.max_scale * c.growth_factor <= SCALE_MAX
        )
