"""Gradient norms exactly as `torch.nn.utils.get_total_norm` computes them, plus each tensor's own.

`total_norm(grads, norm_type, foreach)` returns `(total, per_tensor)`: the same operations in the
same order as torch's (so the total is bitwise torch's), and the per-tensor norms torch computes on
the way (`per_tensor[i]` belongs to `grads[i]`), which name the non-finite gradients for free.
DTensor gradients (FSDP2) take the route Accelerate's `clip_grad_norm_` takes: one total per
device mesh, reduced over its mesh, then combined; `per_tensor` is then `None`.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

from .distributed import is_dtensor


def total_norm(
    grads: list[torch.Tensor], norm_type: float, foreach: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not grads:
        return torch.tensor(0.0), None
    if any(is_dtensor(g) for g in grads):
        return _dtensor_total_norm(grads, norm_type, foreach), None
    if any(g.dtype == torch.float16 for g in grads):
        return _with_fp16(grads, norm_type, foreach)
    grouped = _group_tensors_by_device_and_dtype([grads], with_indices=True)
    norms: list[torch.Tensor | None] = [None] * len(grads)
    in_order: list[torch.Tensor] = []  # torch's order: group by group
    for (device, _), ([tensors], indices) in grouped.items():
        if (foreach is None and _has_foreach_support(tensors, device)) or (
            foreach and _device_has_foreach_support(device)
        ):
            group_norms = list(torch._foreach_norm(tensors, norm_type))
        elif foreach:
            raise RuntimeError(
                f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
            )
        else:
            group_norms = [torch.linalg.vector_norm(g, norm_type) for g in tensors]
        in_order.extend(group_norms)
        for i, n in zip(indices, group_norms, strict=True):
            norms[i] = n
    first = grads[0].device
    stacked = torch.stack([n.to(first) for n in in_order])
    total = torch.linalg.vector_norm(stacked, norm_type)
    if all(a is b for a, b in zip(in_order, norms, strict=True)):  # one group, in order: the same stack
        return total, stacked
    return total, torch.stack([n.to(first) for n in norms])


def _with_fp16(
    grads: list[torch.Tensor], norm_type: float, foreach: bool | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP16 gradients of master weights among them (read, not yet cast): each FP16 norm computed in FP32
    (`dtype=torch.float32`: the norm of the gradient cast to FP32, without the cast's copy), and the
    total over the norms in the order torch takes them when all are FP32 (one group per device, in
    order), so that the total is the one of the gradients cast into the masters."""
    norms: list[torch.Tensor | None] = [None] * len(grads)
    for (device, dtype), ([tensors], indices) in _group_tensors_by_device_and_dtype(
        [grads], with_indices=True
    ).items():
        kw = {"dtype": torch.float32} if dtype == torch.float16 else {}
        if (foreach is None and _has_foreach_support(tensors, device)) or (
            foreach and _device_has_foreach_support(device)
        ):
            group_norms = list(torch._foreach_norm(tensors, norm_type, **kw))
        elif foreach:
            raise RuntimeError(
                f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
            )
        else:
            group_norms = [torch.linalg.vector_norm(g, norm_type, **kw) for g in tensors]
        for i, n in zip(indices, group_norms, strict=True):
            norms[i] = n
    first = grads[0].device
    by_device: dict = defaultdict(list)
    for g, n in zip(grads, norms, strict=True):
        by_device[g.device].append(n)
    in_order = [n for ns in by_device.values() for n in ns]
    total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in in_order]), norm_type)
    return total, torch.stack([n.to(first) for n in norms])


def _dtensor_total_norm(grads: list[torch.Tensor], norm_type: float, foreach: bool | None) -> torch.Tensor:
    from torch.nn.utils import get_total_norm

    by_mesh: dict = defaultdict(list)
    for g in grads:
        by_mesh[g.device_mesh if is_dtensor(g) else None].append(g)
    norms = [get_total_norm(gs, norm_type, foreach=foreach) for gs in by_mesh.values()]
    norms = [n.full_tensor() if is_dtensor(n) else n for n in norms]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)
