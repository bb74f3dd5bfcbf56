"""hf_lossscale: configurable, observable loss scaling for FP16 training with Hugging Face tools.

`import hf_lossscale` imports only torch. The Accelerate and Trainer integrations import
accelerate/transformers when first used (`hf_lossscale.install_loss_scaler`, ...).
"""

from importlib import import_module
from typing import Any

from .config import LossScaleConfig
from .emulation import fp16_emulation, measure_flushed_fraction
from .scaler import DynamicLossScaler, LossScaleCollapseError

__version__ = "0.1.0"

# Public names that live in modules with heavy imports, loaded on first access.
_LAZY = {
    "install_loss_scaler": "accelerate_hook",
    "LossScaleTrainingArguments": "trainer",
    "LossScaleTrainer": "trainer",
    "LossScaleMixin": "trainer",
}

__all__ = [
    "DynamicLossScaler",
    "LossScaleCollapseError",
    "LossScaleConfig",
    "fp16_emulation",
    "measure_flushed_fraction",
    "__version__",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'hf_lossscale' has no attribute {name!r}")
