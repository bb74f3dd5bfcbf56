"""The update rule on device tensors: what `update()` does to the scale, the trackers and the counters,
given the iteration's flags. Functions of their inputs (a `LossScaleConfig`, a materialised
`ScalerState`, the device constants), each testable alone; what they decide comes back as a
`RuleResult`, which the scaler keeps in its `StepOutcome` (`scaler.last_step`):

- `apply_rule`, the general rule, from the flags on the device (no host read);
- `apply_known_rule`, the same for a step whose skip the host already knows (constants stand in
  for the flags);
- `torch_rule_applies`, when torch's own `_amp_update_scale_` kernel computes the config's rule;
- `RuleConstants.on(device)`, the device constants both use (the scaler makes them once per device).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .config import SCALE_MAX
from .distributed import all_reduce_max

if TYPE_CHECKING:
    from .config import LossScaleConfig
    from .scaler_state import ScalerState

__all__ = [
    "RuleConstants",
    "RuleResult",
    "StepOutcome",
    "all_ranks_loss_flag",
    "apply_known_rule",
    "apply_rule",
    "clamp_growth_tracker",
    "torch_rule_applies",
]


class RuleConstants(NamedTuple):
    """The scaler's device constants: a 1.0 (`one`) and the update rule's. The counters' factors are
    [K, A] rows (counters * K + A, see `apply_rule`): `index` picks them from the flags [skipped,
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

    @classmethod
    def on(cls, device: torch.device) -> RuleConstants:
        """The constants on `device` (made afresh: the caller keeps them)."""

        def tensor(value, dtype=None):
            return torch.tensor(value, dtype=dtype, device=device)

        return cls(
            index=tensor([[0, 1, 2, 2, 2], [0, 1, 2, 0, 1]]),
            one=tensor(1.0, torch.float32),
            false=tensor(False),
            true=tensor(True),
            zero=tensor(0.0, torch.float32),
            clean=tensor([[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]),
            skip_ok=tensor([[1, 0, 1, 1, 1], [1, 0, 1, 1, 0]]),
            skip_bad=tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]),
        )


class RuleResult(NamedTuple):
    """What one application of the rule decided, as device flags (no sync): whether a loss of the
    iteration was non-finite (None: no loss was seen), and whether the scale was backed off (a bool
    flag, a float overflow flag where torch's kernel decided, or None outside dynamic mode)."""

    loss_nonfinite: torch.Tensor | None
    backed_off: torch.Tensor | None


class StepOutcome:
    """What the last `update()` decided about its iteration's step: `scaler.last_step`.

    Reads the scaler's state (`ScalerState`) for the skip flag it keeps in the checkpoint; the rest
    is what the rule returned (`RuleResult`) and what the host already knew.
    """

    def __init__(self, state: ScalerState) -> None:
        self._state = state
        #: Whether the step was skipped, where the host knows it without asking the device (every
        #: optimizer of the iteration stepped on the non-fused path, which read the flag in `step()`);
        #: `None` when a fused kernel decided. Never synchronises.
        self.skipped_if_known: bool | None = None
        #: A 0-d bool device flag: was a loss of the iteration non-finite? None when no loss was seen.
        self.loss_nonfinite: torch.Tensor | None = None
        self._backed_off: torch.Tensor | None = None

    def record(self, result: RuleResult) -> None:
        """Take in what the rule decided at an update."""
        self.loss_nonfinite, self._backed_off = result

    @property
    def skipped_tensor(self) -> torch.Tensor | None:
        """A 0-d bool tensor on the device: was the step skipped? No sync (None before the first
        `scale()`). Each `update()` makes a new tensor, so a reference kept stays that step's flag."""
        return self._state["last_step_skipped"] if self._state.materialised else None

    @property
    def skipped(self) -> bool:
        """Whether the step was skipped. Synchronises with the device."""
        if not self._state.materialised:
            return self._state.host["last_step_skipped"]
        return bool(self._state["last_step_skipped"].item())

    @property
    def backed_off(self) -> torch.Tensor | None:
        """A 0-d bool device flag: did the update decide to back the scale off (an overflow counted
        against it, the hysteresis budget spent)? No sync. At the floor the clamp can leave the value
        where it was: whether it moved is the scale against the one the step ran at (telling the two
        apart here would cost one more device op in every update)."""
        if self._backed_off is not None and self._backed_off.dtype != torch.bool:
            self._backed_off = self._backed_off > 0  # one op, only when someone asks
        return self._backed_off


def _power_of_two(x: float) -> bool:
    mantissa, _ = math.frexp(x)
    return x > 0 and mantissa == 0.5


def torch_rule_applies(config: LossScaleConfig) -> bool:
    """Whether torch's `_amp_update_scale_` kernel computes this config's rule exactly: no hysteresis
    (a budget of one overflow: every overflow backs off, the tracker stays full), power-of-two factors
    (exact in FP32 as in FP64), and a ceiling whose growth stays finite in FP32 (the kernel keeps a
    scale whose growth overflows; ours clamps to the ceiling, which is then the same). The growth
    tracker is kept below the interval (`clamp_growth_tracker`), since the kernel grows only when the
    streak *equals* the interval."""
    c = config
    return (
        c.hysteresis == 1
        and _power_of_two(c.growth_factor)
        and _power_of_two(c.backoff_factor)
        and c.max_scale * c.growth_factor <= SCALE_MAX
    )


def clamp_growth_tracker(config: LossScaleConfig, state: ScalerState) -> None:
    """Keep the growth streak below the interval (a streak at or past a lowered interval grows at the
    next clean step either way; torch's kernel needs it below, see `torch_rule_applies`)."""
    top = config.growth_interval - 1
    if state.materialised:
        state["_growth_tracker"].clamp_(max=top)
    else:
        state.host["_growth_tracker"] = min(state.host["_growth_tracker"], top)


def all_ranks_loss_flag(loss_bad: torch.Tensor | None, device: torch.device, group: Any) -> torch.Tensor:
    """Whether any rank's loss was non-finite: one 1-element all-reduce (MAX) on the device, no host
    sync. Under DDP one rank's non-finite loss makes every rank's gradients non-finite; without this,
    that rank would spare the scale while the others back off, and the replicas' scales (and later
    their skips) would drift apart. Every rank takes part, with 0 when it saw no loss."""
    flag = (
        torch.zeros((), dtype=torch.float32, device=device)
        if loss_bad is None
        else loss_bad.to(torch.float32)
    )
    return all_reduce_max(flag, group) > 0


def _overflow_buffer(state: ScalerState) -> torch.Tensor:
    return torch.empty((), dtype=torch.float32, device=state["scale"].device)


def apply_rule(
    config: LossScaleConfig,
    state: ScalerState,
    k: RuleConstants,
    found: torch.Tensor,
    loss_bad: torch.Tensor | None = None,
    bits: torch.Tensor | None = None,
    clamp: bool = True,
) -> RuleResult:
    """The update rule on the device tensors of `state`; `found` is a 0-d bool tensor (the step was
    skipped), `loss_bad` whether a loss of the iteration was non-finite (None: no loss was seen);
    `bits`, when the caller has it, the bool vector [found, loss_bad, True]; `k` the constants on
    `found`'s device.

    A skip whose loss was non-finite is a forward overflow: unless `backoff_on_nonfinite_loss`, it
    leaves the scale and the trackers as they were (no scale can fix it).

    Device ops are kept few (each is a kernel launch on a GPU): the five counters advance together
    (`ScalerState.counters`: x K + A, with K and A picked from the step's flags in one index op), and
    where the rule is torch's (`torch_rule_applies`) the scale and growth tracker move with torch's
    own `_amp_update_scale_` kernel and one clamp into [min_scale, max_scale], left out (`clamp=False`)
    where the host has shown it cannot bind (`SkipWatch.clamp_may_bind`).
    """
    c, s = config, state
    bad = loss_bad if loss_bad is not None else torch.zeros_like(found)
    # flags = [skipped, loss non-finite, 1]; K = flags[[0, 1, 2, 2, 2]], A = flags[[0, 1, 2, 0, 1]]:
    # consecutive = (consecutive + 1) * flag, total += 1, skipped += flag, nonfinite += flag
    if bits is None:
        bits = torch.stack([found, bad, k.true])
    factors = bits[k.index]  # bool: multiplying and adding them into the int64 counters promotes
    torch.addcmul(factors[1], s.counters, factors[0], out=s.counters)  # counters * K + A, one op
    s.replace("last_step_skipped", found)  # a fresh tensor each update: holders keep a snapshot
    if c.mode != "dynamic":
        return RuleResult(loss_bad, None)
    neutral = None if loss_bad is None or c.backoff_on_nonfinite_loss else loss_bad
    if torch_rule_applies(c):
        # the backoff decision: a skip that is not a forward overflow (skipped > loss non-finite)
        overflow = torch.gt(bits[0], bits[1], out=_overflow_buffer(s)) if neutral is not None else (
            found.to(torch.float32))  # fmt: skip
        if neutral is not None:  # a forward overflow neither advances nor resets the growth streak:
            # (the kernel's +1 for a clean step brings it back)
            s["_growth_tracker"].add_(bits[1], alpha=-1)
        torch._amp_update_scale_(
            s["scale"], s["_growth_tracker"], overflow, c.growth_factor, c.backoff_factor, c.growth_interval
        )
        if clamp:
            s["scale"].clamp_(c.min_scale, c.max_scale)
        return RuleResult(loss_bad, overflow)
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
    # Compute in float64 and round once, as torch's _amp_update_scale_ kernels do.
    grown = (scale.double() * c.growth_factor).clamp_(max=c.max_scale).float()
    backed = (scale.double() * c.backoff_factor).clamp_(min=c.min_scale).float()
    scale.copy_(torch.where(back_off, backed, torch.where(grow, grown, scale)))
    growth.copy_(torch.where(grow, 0, growth_after))
    if c.hysteresis > 1:
        refill = grow | (~found) if c.consecutive_hysteresis else grow
        hyst.copy_(torch.where(overflow, hyst_after_overflow, torch.where(refill, c.hysteresis, hyst)))
    return RuleResult(loss_bad, back_off)


def apply_known_rule(
    config: LossScaleConfig,
    state: ScalerState,
    k: RuleConstants,
    skipped: bool,
    probe: torch.Tensor | None,
    clamp: bool = True,
) -> RuleResult:
    """`apply_rule` for a step whose skip the host already knows (the non-fused path reads the flag),
    where the rule is torch's: constants stand in for the flags. A clean step had a finite loss (the
    probe joined the check): fixed counters' factors (streaks end, one more step) and a zero backoff
    flag, three ops (static mode: one). A skipped one: only whether its loss was non-finite comes from
    the device (`probe`: 0 or NaN); it picks one of two factor pairs (K, A for [1, b, 1]: see
    `apply_rule`) and, where such a skip is neutral, clears the backoff flag: seven ops with a probe
    (the general branch: eight), three without."""
    c, s = config, state
    if not skipped:
        loss_bad, factors, overflow = (k.false if probe is not None else None), k.clean, k.zero
    else:
        loss_bad = None if probe is None else probe.ne(0)
        factors = k.skip_ok if loss_bad is None else torch.where(loss_bad, k.skip_bad, k.skip_ok)
        overflow = k.one
    torch.addcmul(factors[1], s.counters, factors[0], out=s.counters)
    s.replace("last_step_skipped", k.true if skipped else k.false)  # constants nobody writes to
    if c.mode != "dynamic":
        return RuleResult(loss_bad, None)
    if skipped and loss_bad is not None and not c.backoff_on_nonfinite_loss:  # a neutral skip
        overflow = torch.eq(loss_bad, False, out=_overflow_buffer(s))
        s["_growth_tracker"].add_(loss_bad, alpha=-1)  # (the kernel's +1 for "no overflow" undone)
    torch._amp_update_scale_(
        s["scale"], s["_growth_tracker"], overflow, c.growth_factor, c.backoff_factor, c.growth_interval
    )
    if clamp:
        s["scale"].clamp_(c.min_scale, c.max_scale)
    return RuleResult(loss_bad, overflow if skipped else k.false)
