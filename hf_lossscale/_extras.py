"""Optional dependencies: imported where a feature uses them, with the extra that installs them named.

The core (`pip install hf_lossscale`: the scaler, the Accelerate hook, the Trainer) needs torch,
accelerate, transformers and PyYAML. The command-line tools' plots and data loading need the `tools`
extra (matplotlib, datasets); the recipes need `recipes` (datasets, evaluate, scikit-learn).
"""

from __future__ import annotations

import importlib
from types import ModuleType


def need(module: str, feature: str, extra: str) -> ModuleType:
    """`module`, imported; an ImportError naming `extra` when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        raise ImportError(
            f"{feature} needs `{top}`, which the core install leaves out: pip install 'hf_lossscale[{extra}]'"
        ) from e
