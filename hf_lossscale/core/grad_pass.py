"""The gradient pass: one read of an optimizer's gradients that unscales them in place and checks them
for inf/NaN, as functions of their inputs (an optimizer, a scale's reciprocal, where each device's
flag comes from), each testable alone. The scaler's `unscale_`, `step` and `clip_grad_norm_` run them;
torch's `GradScaler._unscale_grads_` is the model.
"""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from ..masters.pair import PendingGradient
from .distributed import all_reduce_max

__all__ = [
    "check_",
    "clamp_nonfinite_",
    "fused_sgd_first_step",
    "group_grads",
    "max_over_ranks",
    "mul_grads_",
    "takes_grad_scaler",
    "unscale_and_check_",
]

#: Gradients by device, then dtype (sparse ones by their values), as torch's scaler groups them.
Grouped = dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]

_MAX_NAMES = 8  # parameter names shown in the FP16-parameter error


def group_grads(
    optimizer: torch.optim.Optimizer,
    name_of: Callable[[torch.Tensor, torch.optim.Optimizer], str],
    allow_fp16: bool = False,
) -> Grouped:
    """The optimizer's gradients grouped by device and dtype (an FP16 sparse gradient coalesced first,
    so entries at one index add up before the check). Parameters held in BF16, and in FP16 unless
    `allow_fp16`, are refused with a `ValueError` naming them (by `name_of`) and the remedies."""
    grouped: Grouped = defaultdict(lambda: defaultdict(list))
    fp16_params, bf16_params = [], []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None or isinstance(param.grad, PendingGradient):  # (FP16, read apart)
                continue
            if param.dtype == torch.float16 and not allow_fp16:
                fp16_params.append(name_of(param, optimizer))
                continue
            if param.dtype == torch.bfloat16:
                bf16_params.append(name_of(param, optimizer))
                continue
            grad = param.grad
            if grad.is_sparse:
                if grad.dtype is torch.float16:
                    param.grad = grad = grad.coalesce()
                grad = grad._values()
            grouped[grad.device][grad.dtype].append(grad)
    if bf16_params:
        raise ValueError(
            f"{len(bf16_params)} trainable parameter(s) are held in bfloat16: {_shown(bf16_params)}, under an FP16 "
            "loss scaler (torch's fails on them in a kernel: '_amp_foreach_non_finite_check_and_unscale_cuda' not "
            "implemented for 'BFloat16'). BF16 has FP32's range and needs no loss scaling: train with "
            "bf16=True (mixed_precision='bf16', no scaler), or hold the parameters in FP32 (fp16=True, autocast) "
            "or FP16 (master weights)."
        )
    if fp16_params:
        raise ValueError(
            f"{len(fp16_params)} trainable parameter(s) are held in float16: {_shown(fp16_params)}. "
            "Loss scaling needs FP32 master weights: load the model in float32 (drop "
            "`torch_dtype=torch.float16` / `dtype=torch.float16` from from_pretrained) and let "
            "autocast (`fp16=True` / `mixed_precision='fp16'`) run the FP16 compute, freeze "
            "those parameters, or let the optimizer step on FP32 master copies of them "
            "(master_weights='auto' or True: --loss_scale_master_weights auto, HF_LOSSSCALE_MASTER_WEIGHTS)."
        )
    return grouped


def _shown(names: list[str]) -> str:
    more = f" (and {len(names) - _MAX_NAMES} more)" if len(names) > _MAX_NAMES else ""
    return ", ".join(names[:_MAX_NAMES]) + more


def unscale_and_check_(
    grouped: Grouped, inv_scale: torch.Tensor, flag_for: Callable[[torch.device], torch.Tensor]
) -> dict[torch.device, torch.Tensor]:
    """Multiply the gradients by `inv_scale` in place and set each device's found-inf flag (made by
    `flag_for(device)`, once per device) where one holds inf/NaN: torch's fused kernel, one call per
    device and dtype, no host sync. Returns the flags by device (empty without gradients)."""
    found: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for device, per_dtype in grouped.items():
            flag = found[device] = flag_for(device)
            inv = inv_scale.to(device, non_blocking=True)
            for grads in per_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv)
    return found


def check_(
    grads: list[torch.Tensor],
    found: dict[torch.device, torch.Tensor],
    flag_for: Callable[[torch.device], torch.Tensor],
    one: torch.Tensor,
) -> None:
    """Set each device's found-inf flag in `found` (made by `flag_for` for a device not there yet) where
    one of `grads` holds inf/NaN, without changing them (multiplied by 1 in place: FP16 gradients of
    master weights, which the step unscales in FP32)."""
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        by_device[g.device].append(g)
    with torch.no_grad():
        for device, tensors in by_device.items():
            flag = found.get(device)
            if flag is None:
                flag = found[device] = flag_for(device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, one.to(device, non_blocking=True))


def max_over_ranks(
    found: dict[torch.device, torch.Tensor], device: torch.device, group: Any
) -> dict[torch.device, torch.Tensor]:
    """One flag on `device`: the maximum over `found`'s devices and over the ranks of `group` (one
    all-reduce, queued on the device), so every rank skips and backs off together."""
    flag = all_reduce_max(torch.stack([f.reshape(()).to(device) for f in found.values()]).amax(), group)
    return {flag.device: flag}


def clamp_nonfinite_(optimizer: torch.optim.Optimizer, limit: float) -> None:
    """The optimizer's gradients with NaN as 0 and +-inf as +-`limit`, in place (sparse: their values)."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    values = param.grad._values() if param.grad.is_sparse else param.grad
                    torch.nan_to_num_(values, nan=0.0, posinf=limit, neginf=-limit)


def fused_sgd_first_step(
    optimizer: torch.optim.Optimizer,
    grad_of: Callable[[torch.optim.Optimizer, torch.Tensor], torch.Tensor | None] | None = None,
) -> bool:
    """A fused SGD with momentum whose momentum buffers do not exist yet (its first step); `grad_of`
    reads a parameter's gradient (default: `.grad`)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    grad_of = grad_of or (lambda opt, p: p.grad)
    return any(
        group.get("fused")
        and group["momentum"] != 0
        and any(
            grad_of(optimizer, p) is not None and "momentum_buffer" not in optimizer.state.get(p, {})
            for p in group["params"]
        )
        for group in optimizer.param_groups
    )


def mul_grads_(grouped: Grouped, factor: torch.Tensor, foreach: bool | None) -> None:
    """Multiply gradients grouped by device and dtype by a 0-d tensor, in place, as torch's
    `clip_grads_with_norm_` does (foreach where supported, else tensor by tensor)."""
    from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support

    for device, per_dtype in grouped.items():
        f = factor.to(device, non_blocking=True)
        for grads in per_dtype.values():
            if (foreach is None and _has_foreach_support(grads, device)) or (
                foreach and _device_has_foreach_support(device)
            ):
                torch._foreach_mul_(grads, f)
            elif foreach:
                raise RuntimeError(
                    f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
                )
            else:
                for g in grads:
                    g.mul_(f)


def takes_grad_scaler(step: Any) -> bool:
    """Whether an optimizer's `step` takes `grad_scaler=` (torch's older contract); the signature is
    read once per step function, not on every step."""
    func = getattr(step, "__func__", step)
    try:
        return _signature_takes_grad_scaler(func)
    except TypeError:  # an unhashable callable: read its signature each time
        return "grad_scaler" in inspect.signature(func).parameters


@functools.lru_cache(maxsize=64)
def _signature_takes_grad_scaler(func: Any) -> bool:
    return "grad_scaler" in inspect.signature(func).parameters
