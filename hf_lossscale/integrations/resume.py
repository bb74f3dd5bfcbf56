"""The resume rule, one for the Trainer and for `accelerator.load_state` (issue 48): every setting
comes from what the user passes now, the checkpoint gives the dynamic state (scale, trackers,
counters), and one line lists the settings that differ from the checkpoint's. A plain
`DynamicLossScaler.load_state_dict` keeps torch's semantics (it restores torch's three fields)."""

from __future__ import annotations

from typing import Any

from ..core.config import LossScaleConfig
from ..core.scaler import DynamicLossScaler
from .training_args import shown

__all__ = ["LOAD_CONFIG_WARNINGS", "config_differences", "restore_settings", "resume_line"]

#: What `DynamicLossScaler.load_state_dict` warns about the config (the resume's one line replaces it).
LOAD_CONFIG_WARNINGS = (
    "Restored from the loss-scaler state",
    "Loaded loss-scaler state was written with a different config",
    "GradScaler state has",
)


def config_differences(state: dict[str, Any], current: LossScaleConfig) -> str:
    """`field now (checkpoint was)` for each of the scaler's settings (`LossScaleConfig.scaler_dict()`)
    that differs from the checkpoint's (our state's `config`, or the fields a torch GradScaler state
    carries); "" when none does."""
    saved = state.get("config")
    if not isinstance(saved, dict):
        saved = {k: state[k] for k in ("growth_factor", "backoff_factor", "growth_interval") if k in state}
    # the scaler's own fields: an old checkpoint's FP16 handling (`FP16_FIELDS`) is the model's, not compared
    now = current.scaler_dict()
    now.pop("init_scale")  # a resumed scaler starts from the checkpoint's scale, whatever the setting
    return ", ".join(
        f"{k} {shown(now[k])} (checkpoint {shown(v)})"
        for k, v in sorted(saved.items())
        if k in now and now[k] != v
    )


def restore_settings(scaler: DynamicLossScaler, current: LossScaleConfig) -> None:
    """Put this run's settings back after `load_state_dict`, which restores growth_factor,
    backoff_factor and growth_interval from the state, as torch's GradScaler does."""
    for name, setter in (("growth_factor", scaler.set_growth_factor),
                         ("backoff_factor", scaler.set_backoff_factor),
                         ("growth_interval", scaler.set_growth_interval)):  # fmt: skip
        if getattr(scaler.config, name) != getattr(current, name):
            setter(getattr(current, name))


def resume_line(
    state: dict[str, Any], current: LossScaleConfig, path: str, scale: float | None = None
) -> str | None:
    """The one line a resume logs, or None when nothing differs from the checkpoint: its settings,
    and the scale the scaler resumed at (`scale`) where it is not the checkpoint's (clamped into this
    run's `[min_scale, max_scale]`, or static mode's own)."""
    differs = config_differences(state, current)
    saved = state.get("scale")
    if scale is not None and isinstance(saved, (int, float)) and current.mode != "off" and saved != scale:
        moved = f"scale {shown(float(scale))} (checkpoint {shown(float(saved))}: this run's range or static scale)"
        differs = f"{differs}, {moved}" if differs else moved
    if not differs:
        return None
    return (
        f"hf_lossscale: resumed the loss scaler from {path}: scale, trackers and counters from the checkpoint, "
        f"every setting from this run; differing from the checkpoint: {differs}."
    )
