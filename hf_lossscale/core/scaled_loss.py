"""A scaled loss whose backward runs under a context (`ScaledLoss`).

`install_loss_scaler` on a CPU with emulated FP16 gives the scaler the emulation as its backward
context: Accelerate's `accelerator.backward(loss)` calls `scaler.scale(loss).backward()`, so the
backward then runs with the emulation on (what gradient checkpointing recomputes during it computes
as the forward did) without the accelerator's own method being replaced.

Imports only torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ScaledLoss", "with_backward_context"]

_CONTEXT = "_hf_backward_context"
_BACKWARDS = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)


def _plain(t: ScaledLoss) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


class ScaledLoss(torch.Tensor):
    """A tensor whose `backward()` (and `torch.autograd.backward`/`grad` of it) runs under its context;
    every other call on it gives plain tensors, as on the loss it stands for."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _BACKWARDS:
            found: list[ScaledLoss] = []
            args, kwargs = torch.utils._pytree.tree_map_only(
                ScaledLoss, lambda t: found.append(t) or _plain(t), (args, kwargs)
            )
            # the backward itself runs on plain tensors, with torch functions on (other subclasses, such
            # as the masters' gradient stand-ins, keep their behaviour in its hooks)
            with found[0].__dict__[_CONTEXT]():
                return func(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __format__(self, spec: str) -> str:  # `f"{loss:.3f}"`, as on the plain loss
        return format(_plain(self), spec)


def with_backward_context(
    value: torch.Tensor, context: Callable[[], contextlib.AbstractContextManager] | None
) -> torch.Tensor:
    """`value` as a `ScaledLoss` whose backward runs under `context()` (the tensor itself without one)."""
    if context is None:
        return value
    out = value.as_subclass(ScaledLoss)
    out.__dict__[_CONTEXT] = context
    return out
