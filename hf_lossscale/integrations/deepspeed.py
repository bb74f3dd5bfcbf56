"""DeepSpeed: the `fp16` section of a DeepSpeed config that comes closest to a `LossScaleConfig`.

Under DeepSpeed the engine owns the loss scaler; `to_deepspeed_config(config)` writes the settings it
can take, and names those it cannot. Imports neither DeepSpeed nor torch.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from ..core.config import LossScaleConfig

__all__ = ["to_deepspeed_config"]


def to_deepspeed_config(config: LossScaleConfig) -> dict[str, Any]:
    """The DeepSpeed `fp16` section that comes closest to `config` (DeepSpeed owns its scaler).

    Dynamic mode maps to `loss_scale: 0`, `initial_scale_power`, `loss_scale_window`
    (growth_interval), `hysteresis`, `consecutive_hysteresis`, `min_loss_scale`; static mode to
    `loss_scale: init_scale`; off to `enabled: false`. A `UserWarning` names each setting DeepSpeed
    cannot express and the rule differences.

    Args:
        config (`LossScaleConfig`): the loss-scale settings of the run.

    Example:

    ```python
    >>> from hf_lossscale import LossScaleConfig
    >>> from hf_lossscale.integrations.deepspeed import to_deepspeed_config
    >>> to_deepspeed_config(LossScaleConfig(init_scale=2.0**12, hysteresis=2))["initial_scale_power"]  # doctest: +SKIP
    12
    ```
    """
    c = config
    if c.mode == "off":
        return {"enabled": False}
    if c.mode == "static":
        return {"enabled": True, "loss_scale": c.init_scale}
    power = math.log2(c.init_scale)
    problems = []
    if not power.is_integer():
        problems.append(f"init_scale={c.init_scale:g} is not a power of two (rounded to 2^{round(power)})")
    if c.growth_factor != 2.0:
        problems.append(f"growth_factor={c.growth_factor:g} (DeepSpeed always multiplies by 2)")
    if c.backoff_factor != 0.5:
        problems.append(f"backoff_factor={c.backoff_factor:g} (DeepSpeed always divides by 2)")
    problems.append(f"max_scale={c.max_scale:g} (DeepSpeed has no ceiling)")
    if c.max_consecutive_skips is not None:
        problems.append(f"max_consecutive_skips={c.max_consecutive_skips} (no equivalent)")
    problems.append(
        "rule difference: DeepSpeed grows when (step - last overflow step) is a multiple of "
        "loss_scale_window, counting its window since the last overflow"
    )
    warnings.warn(
        "to_deepspeed_config: not expressible in DeepSpeed: " + "; ".join(problems) + ".",
        stacklevel=2,
    )
    return {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": int(round(power)),
        "loss_scale_window": c.growth_interval,
        "hysteresis": c.hysteresis,
        "consecutive_hysteresis": c.consecutive_hysteresis,
        "min_loss_scale": c.min_scale,
    }
