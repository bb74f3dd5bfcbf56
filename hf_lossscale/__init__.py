"""hf_lossscale: configurable, observable loss scaling for FP16 training with Hugging Face tools.

`import hf_lossscale` imports nothing heavy: each public name loads its module on first access, so
the scaler imports only torch, the config (`hf_lossscale.config`) not even torch, and the Accelerate
and Trainer integrations import accelerate/transformers when first used.
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# Public names, loaded with their module on first access.
_LAZY = {
    "LossScaleConfig": "core.config",
    "fp16_emulation": "fp16.emulation",
    "measure_flushed_fraction": "fp16.emulation",
    "DynamicLossScaler": "core.scaler",
    "LossScaleCollapseError": "core.scaler",
    "install_loss_scaler": "integrations.accelerate_hook",
    "LossScaleTrainingArguments": "integrations.training_args",
    "LossScaleTrainer": "integrations.trainer",
    "LossScaleMixin": "integrations.trainer",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'hf_lossscale' has no attribute {name!r}")
