"""`LossScaleTrainingArguments`: `TrainingArguments` with the loss-scale settings (`--loss_scale_*`)."""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from ..core.config import LossScaleConfig, resolve_config
from ..core.events import EVENT_LOG_NAME

__all__ = ["ARG_TO_FIELD", "LossScaleTrainingArguments", "shown"]

#: `LossScaleTrainingArguments` field -> `LossScaleConfig` field.
ARG_TO_FIELD = {
    "loss_scale_mode": "mode",
    "loss_scale_init": "init_scale",
    "loss_scale_growth_factor": "growth_factor",
    "loss_scale_backoff_factor": "backoff_factor",
    "loss_scale_growth_interval": "growth_interval",
    "loss_scale_min": "min_scale",
    "loss_scale_max": "max_scale",
    "loss_scale_hysteresis": "hysteresis",
    "loss_scale_consecutive_hysteresis": "consecutive_hysteresis",
    "loss_scale_max_consecutive_skips": "max_consecutive_skips",
    "loss_scale_fp16_on_cpu": "fp16_on_cpu",
    "loss_scale_telemetry_interval": "telemetry_interval",
    "loss_scale_backoff_on_nonfinite_loss": "backoff_on_nonfinite_loss",
    "loss_scale_fp32_modules": "fp32_modules",
    "loss_scale_max_auto_fp32_modules": "max_auto_fp32_modules",
    "loss_scale_at_min_scale": "at_min_scale",
    "loss_scale_floor_event_steps": "floor_event_steps",
    "loss_scale_master_weights": "master_weights",
}


def shown(value: Any) -> str:
    """A default as a user would type it: powers of two as 2**k, an empty tuple as none."""
    if isinstance(value, float) and value >= 1024 and math.log2(value).is_integer():
        return f"2**{int(math.log2(value))}"
    if isinstance(value, tuple):
        return ",".join(value) or "none"
    return repr(value)


def _setting(config_field: str, extra: str = "") -> Any:
    """A `loss_scale_*` argument for one `LossScaleConfig` field: default None ("not set"); its help is
    the config field's, with the config's default."""
    spec = next(f for f in dataclasses.fields(LossScaleConfig) if f.name == config_field)
    return field(
        default=None, metadata={"help": f"{spec.metadata['help']} (default {shown(spec.default)}{extra})"}
    )


@dataclass
class LossScaleTrainingArguments(TrainingArguments):
    """`TrainingArguments` with the loss-scale settings. `None` means "not set".

    Set fields win over the `HF_LOSSSCALE_*` environment variables and the `HF_LOSSSCALE_CONFIG`
    file; an explicit `loss_scale_config=` given to the trainer wins over all of them. Values are
    validated here, through `LossScaleConfig`, so a bad flag fails at argument time.
    """

    # The settings, one per `LossScaleConfig` field (`ARG_TO_FIELD`): None means "not set"; the help
    # text and the default it names come from the config field (tests/test_config.py checks each).
    loss_scale_mode: str | None = _setting("mode")
    loss_scale_init: float | None = _setting("init_scale")
    loss_scale_growth_factor: float | None = _setting("growth_factor")
    loss_scale_backoff_factor: float | None = _setting("backoff_factor")
    loss_scale_growth_interval: int | None = _setting("growth_interval")
    loss_scale_min: float | None = _setting("min_scale")
    loss_scale_max: float | None = _setting("max_scale")
    loss_scale_hysteresis: int | None = _setting("hysteresis")
    loss_scale_consecutive_hysteresis: bool | None = _setting("consecutive_hysteresis")
    loss_scale_max_consecutive_skips: int | None = _setting("max_consecutive_skips", "; 0 disables the check")
    loss_scale_fp16_on_cpu: str | None = _setting("fp16_on_cpu")
    loss_scale_telemetry_interval: int | None = _setting(
        "telemetry_interval", "; logged as grad_zero_frac, grad_subnormal_frac, headroom_bits"
    )
    loss_scale_backoff_on_nonfinite_loss: bool | None = _setting("backoff_on_nonfinite_loss")
    loss_scale_fp32_modules: str | None = _setting("fp32_modules")
    loss_scale_max_auto_fp32_modules: int | None = _setting("max_auto_fp32_modules")
    loss_scale_at_min_scale: str | None = _setting("at_min_scale")
    loss_scale_floor_event_steps: int | None = _setting("floor_event_steps")
    loss_scale_master_weights: str | None = _setting(
        "master_weights", "; auto, true, false, kahan or stochastic_rounding"
    )
    loss_scale_preflight: bool = field(
        default=False,
        metadata={
            "help": "Before the first step, run `hf-lossscale preflight` on the first batch (FP32 passes): "
            "warn with the table of modules that would overflow in FP16 or come within 2 bits of it."
        },
    )
    loss_scale_activation_probe: bool = field(
        default=False,
        metadata={
            "help": "Also histogram the activation gradients at module boundaries (sampled) on telemetry "
            "steps, where FP16 underflow happens; logged as act_grad_lost_frac."
        },
    )
    loss_scale_fresh_on_resume: bool = field(
        default=False,
        metadata={"help": "On resume, start a fresh scaler when the checkpoint has no usable scaler state."},
    )
    loss_scale_measure_flushed: bool = field(
        default=False,
        metadata={
            "help": "Measure the fraction of gradient elements that FP16 flushes to zero (against an FP32 "
            "pass on the first training batch) at the start and the end of training, at the scale in force."
        },
    )
    loss_scale_fix_accumulated_loss: bool = field(
        default=True,
        metadata={
            "help": "Under gradient accumulation, divide each micro-batch's loss by the accumulation steps for a "
            "model whose forward takes **kwargs but ignores num_items_in_batch (otherwise the Trainer sums "
            "the micro-batch means: gradients x N). False keeps the Trainer's own behaviour."
        },
    )
    loss_scale_event_log: bool = field(
        default=True,
        metadata={
            "help": f"Write the JSONL event log `{EVENT_LOG_NAME}` (scale, skips, logs) to output_dir."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        flags = {name: f"--{arg}" for arg, name in ARG_TO_FIELD.items()}
        resolve_config(None, self.loss_scale_overrides(), override_source=flags)  # validate now
        # `fp16_on_cpu` also applies to a model held in FP16 without --fp16 (pure FP16 on a CPU): the
        # Trainer, which sees the model, warns about it when it does not
        set_args = [n for n in ARG_TO_FIELD if getattr(self, n) is not None and n != "loss_scale_fp16_on_cpu"]
        if set_args and not self.fp16_effective:
            warnings.warn(
                f"{set_args} are set but FP16 is off (fp16=False and ACCELERATE_MIXED_PRECISION is not "
                "'fp16'): they have no effect.",
                stacklevel=2,
            )

    @property
    def fp16_effective(self) -> bool:
        """FP16 as the Trainer's Accelerator will see it (`ACCELERATE_MIXED_PRECISION` can set it)."""
        return bool(self.fp16) or os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "fp16"

    def loss_scale_overrides(self) -> dict[str, Any]:
        """The `LossScaleConfig` fields the user set, by config field name."""
        out = {
            name: getattr(self, arg) for arg, name in ARG_TO_FIELD.items() if getattr(self, arg) is not None
        }
        if out.get("max_consecutive_skips") == 0:
            out["max_consecutive_skips"] = None  # 0 on the command line disables the collapse check
        return out
