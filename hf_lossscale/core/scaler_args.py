"""`DynamicLossScaler`'s constructor arguments, ours and `torch.amp.GradScaler`'s signature
(`GradScaler(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)`), resolved
into the config and the device the scaler runs with. Imports only torch.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .config import LossScaleConfig

__all__ = ["TORCH_ARGS", "scaler_arguments"]

#: `torch.amp.GradScaler`'s arguments after the device, in its order: config fields here.
TORCH_ARGS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


def scaler_arguments(
    config: LossScaleConfig | str | torch.device | None,
    torch_args: tuple[Any, ...],
    enabled: bool,
    device: str | torch.device | None,
    overrides: dict[str, Any],
) -> tuple[LossScaleConfig, torch.device | None]:
    """The config and device for `DynamicLossScaler(config, *torch_args, enabled, device=, **overrides)`.

    `config` may be torch's first argument, the device; `torch_args` are torch's next four (`TORCH_ARGS`,
    None where not given), config fields over `config`, as are `overrides`; `enabled=False` is
    `mode="off"`. Errors name what was given twice, an unknown field, or a CUDA device without CUDA.
    """
    if isinstance(config, (str, torch.device)):  # torch's signature: GradScaler(device, init_scale, ...)
        if device is not None:
            raise TypeError(f"DynamicLossScaler got the device twice: {config!r} and device={device!r}.")
        config, device = None, config
    given = {name: value for name, value in zip(TORCH_ARGS, torch_args, strict=True) if value is not None}
    twice = sorted(set(given) & set(overrides))
    if twice:
        raise TypeError(f"DynamicLossScaler got {twice} twice.")
    overrides = {**given, **overrides}
    if config is None:
        config = LossScaleConfig(**_torch_ceiling(_check_overrides(overrides)))
    elif not isinstance(config, LossScaleConfig):
        raise TypeError(f"config must be a LossScaleConfig, got {type(config).__name__}.")
    elif overrides:
        config = config.replace(**_check_overrides(overrides))
    if not enabled:
        config = config.replace(mode="off")
    if device is not None and enabled:
        device = _check_device(device)
    return config, torch.device(device) if device is not None else None


def _torch_ceiling(overrides: dict[str, Any]) -> dict[str, Any]:
    """torch's `GradScaler(init_scale=...)` has no ceiling: given an `init_scale` above the default
    `max_scale` and no `max_scale`, the ceiling rises to it (growth then stays at that scale, as torch's
    leaves a scale whose growth would overflow)."""
    init = overrides.get("init_scale")
    default = LossScaleConfig.__dataclass_fields__["max_scale"].default
    if "max_scale" not in overrides and isinstance(init, (int, float)) and not isinstance(init, bool):
        if math.isfinite(init) and init > default:
            return {**overrides, "max_scale": float(init)}
    return overrides


def _check_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(overrides) - set(LossScaleConfig.field_names()))
    if unknown:
        raise TypeError(
            f"DynamicLossScaler got unknown keyword(s) {unknown}; "
            f"config fields are {list(LossScaleConfig.field_names())}."
        )
    return overrides


def _check_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"DynamicLossScaler(device={str(device)!r}) but CUDA is not available on this machine; "
            "pass device='cpu' or device=None (the device of the loss)."
        )
    return device
