"""A pure-Python model of the update rule, written from the spec, used as the test oracle."""

from __future__ import annotations

from dataclasses import dataclass

from hf_lossscale import LossScaleConfig


@dataclass
class ReferenceScaler:
    config: LossScaleConfig
    scale: float = 0.0
    growth_tracker: int = 0
    hysteresis_tracker: int = 0
    total_steps: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    nonfinite_loss_steps: int = 0
    consecutive_nonfinite_loss: int = 0

    def __post_init__(self) -> None:
        self.scale = 1.0 if self.config.mode == "off" else self.config.init_scale
        self.hysteresis_tracker = self.config.hysteresis

    def update(self, overflow: bool, loss_nonfinite: bool = False) -> None:
        """One iteration: `overflow` (the step was skipped), `loss_nonfinite` (a loss of it was
        non-finite: the step is skipped whatever the gradients hold)."""
        c = self.config
        self.total_steps += 1
        if c.mode == "off":
            return
        overflow = overflow or loss_nonfinite
        self.skipped_steps += overflow
        self.consecutive_skips = self.consecutive_skips + 1 if overflow else 0
        self.nonfinite_loss_steps += loss_nonfinite
        self.consecutive_nonfinite_loss = self.consecutive_nonfinite_loss + 1 if loss_nonfinite else 0
        if c.mode == "static":
            return
        if loss_nonfinite and not c.backoff_on_nonfinite_loss:
            # The spec (LossScaleConfig.backoff_on_nonfinite_loss): a forward overflow, which no
            # scale can fix, leaves the scale and both trackers as they were.
            return
        if overflow:
            self.growth_tracker = 0
            # The spec (LossScaleConfig: "overflowing steps tolerated before a backoff"): the
            # hysteresis tracker is a budget of overflows still tolerated. An overflow spends one
            # while any is left; with none left after it, the scale backs off, and keeps backing
            # off on every further overflow until a growth (or, with consecutive_hysteresis, a
            # clean step) refills the budget. A budget cannot be negative: it stays at 0 (unlike
            # Megatron/DeepSpeed's tracker, which counts on below 0; both back off at the same
            # steps, but the value is checkpointed, so the spec names which one it is).
            # With hysteresis 1 (a budget of one overflow) every overflow backs off and there is
            # nothing to count down: the tracker stays full (1).
            if self.hysteresis_tracker > 0 and c.hysteresis > 1:
                self.hysteresis_tracker -= 1
            if self.hysteresis_tracker == 0 or c.hysteresis == 1:
                self.scale = max(_f32(self.scale * c.backoff_factor), c.min_scale)
        else:
            self.growth_tracker += 1
            if c.consecutive_hysteresis:
                self.hysteresis_tracker = c.hysteresis
            if self.growth_tracker == c.growth_interval:
                self.scale = min(_f32(self.scale * c.growth_factor), c.max_scale)
                self.growth_tracker = 0
                self.hysteresis_tracker = c.hysteresis


def _f32(x: float) -> float:
    import struct

    return struct.unpack("f", struct.pack("f", x))[0]
