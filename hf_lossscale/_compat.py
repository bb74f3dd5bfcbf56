"""The accelerate / transformers versions and internals the integration is tested against.

`tests/test_compat.py` fails loudly when the installed versions or these internals change, so an
upgrade is re-verified before it ships.
"""

from __future__ import annotations

TESTED_VERSIONS = {"accelerate": "1.16", "transformers": "5.24", "torch": "2.13"}

# Internals we rely on: (module, attribute path).
INTERNALS = [
    ("accelerate.optimizer", "AcceleratedOptimizer"),
    ("accelerate.optimizer", "patch_optimizer_step"),
    ("accelerate.accelerator", "Accelerator.unscale_gradients"),
    ("accelerate.accelerator", "Accelerator.clip_grad_norm_"),
    ("transformers.trainer", "SCALER_NAME"),
    ("transformers.trainer", "Trainer._save_scaler"),
    ("transformers.trainer", "Trainer._load_scaler"),
]


def major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])
