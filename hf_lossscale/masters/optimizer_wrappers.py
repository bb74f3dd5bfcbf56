"""The torch optimizer inside the wrappers that training libraries put around it (Accelerate's
`AcceleratedOptimizer`, our `LossScaledOptimizer`): the one the scaler, the master weights and the
integrations key their state by. Recognised by attribute, so it imports only torch.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["inner_optimizer"]


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside `optimizer`'s wrappers (each holding the next as `.optimizer`), or
    `optimizer` itself when it wraps none."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer
