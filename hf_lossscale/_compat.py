"""The accelerate / transformers / torch versions and internals the integration is tested against.

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
    # Accelerate's clip path, which install_loss_scaler routes through DynamicLossScaler.clip_grad_norm_
    ("accelerate.accelerator", "Accelerator._clip_grad_norm_dtensor_aware"),
    ("accelerate.accelerator", "Accelerator.is_fsdp2"),
    # torch's clip_grad_norm_ internals, reproduced step for step so the norm is bitwise torch's
    ("torch.utils._foreach_utils", "_group_tensors_by_device_and_dtype"),
    ("torch.utils._foreach_utils", "_has_foreach_support"),
    ("torch.utils._foreach_utils", "_device_has_foreach_support"),
    ("torch", "_foreach_norm"),
    ("torch", "_foreach_mul_"),
    ("torch", "_amp_foreach_non_finite_check_and_unscale_"),
]


def major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])
