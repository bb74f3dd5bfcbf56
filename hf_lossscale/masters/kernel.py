"""One pass over memory for the FP32-master Adam/AdamW step on CUDA (issue 49): a Triton kernel.

For each FP16 parameter the kernel reads its FP16 gradient once, and in the same pass multiplies it
by the unscale (and clip) factor, divides it by a fused optimizer's `grad_scale`, runs Adam or AdamW on
the FP32 master and moments (torch's fused arithmetic), and writes the master, the moments and the
FP16 weight. A step whose `found_inf` is set writes nothing. Everything it reads is on the device (the
factor, `grad_scale`, `found_inf`, the step counter of a fused or capturable group), so it adds no
host sync and a CUDA graph can capture it.

Reading the gradient once more than this is not avoidable: whether a step is skipped (and the clip's
norm) depends on every gradient, so the scaler's read-only check (`grad_pass.check_`, the FP16
gradients as they are, or `_foreach_norm` for the clip) comes before any write.

It runs where Triton is importable and the parameters are on CUDA (torch's CUDA wheels ship Triton);
elsewhere the chunked update of `masters.step` runs, bitwise torch's optimizer. `TRITON_INTERPRET=1`
runs the kernel on a CPU (slowly), which is how its tests check it against torch's AdamW without a GPU.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["OnePassSlot", "one_pass_reason", "run_one_pass", "triton_available"]

#: Elements per Triton program.
BLOCK = 1024


@dataclass(eq=False)
class OnePassSlot:
    """One parameter's tensors for the kernel: the FP16 gradient (scaled or not), its factor (None: 1),
    the FP32 master, the FP16 weight and the key of the optimizer's state."""

    key: torch.Tensor
    grad: torch.Tensor
    factor: torch.Tensor | None
    master: torch.Tensor
    weight: torch.Tensor


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def one_pass_reason(optimizer: torch.optim.Optimizer, group: dict, slots: list[OnePassSlot]) -> str | None:
    """None when the kernel can run this group's update of `slots`; otherwise why not (in words)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return "not Adam or AdamW"
    if group["amsgrad"] or group["maximize"] or group.get("differentiable"):
        return "amsgrad, maximize or differentiable"
    if torch.is_tensor(group["lr"]):
        return "a tensor learning rate"
    for s in slots:
        if s.grad.dtype != torch.float16 or s.master.dtype != torch.float32:
            return "not an FP16 gradient with an FP32 master"
        if not (s.grad.is_contiguous() and s.master.is_contiguous() and s.weight.is_contiguous()):
            return "a non-contiguous tensor"
        if s.master.device.type != "cuda" and not _interpreting():
            return "not on CUDA"
    if not triton_available():
        return "Triton is not installed"
    return None


def _counter_on_device(step: torch.Tensor, master: torch.Tensor) -> bool:
    """Whether a step counter lives beside its master (fused or capturable groups), not on the host."""
    return step.device == master.device


def _fp32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _split(x: float) -> tuple[float, float]:
    """A double as the sum of two FP32 numbers (the kernel widens them back)."""
    hi = float(torch.tensor(x, dtype=torch.float32))
    return hi, float(torch.tensor(x - hi, dtype=torch.float32))


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def master_adam(
        grad_ptr, factor_ptr, scale_ptr, inf_ptr, step_ptr,
        master_ptr, exp_avg_ptr, exp_avg_sq_ptr, weight_ptr, n,
        lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo, eps_hi, eps_lo, wd_hi, wd_lo,
        step_size_host, bc2_sqrt_host,
        HAS_FACTOR: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, HAS_WD: tl.constexpr,
        STEP_ON_DEVICE: tl.constexpr, DECOUPLED: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # torch's fused CUDA Adam (`adam_math` in fused_adam_utils.cuh), in its order and precisions:
        # hyperparameters are doubles (here to 48 bits: two floats), the bias corrections and the values
        # FP32 ("opmath"), so each expression that mixes a hyperparameter in is computed in double and
        # rounded to FP32 where torch stores it.
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if HAS_INF:  # a skipped step writes nothing
            mask = mask & (tl.load(inf_ptr + offs * 0) == 0)  # the flag, read by every lane
        grad = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_FACTOR:  # the unscale (and clip) factor, as the chunked path casts: FP32
            grad = grad * tl.load(factor_ptr + offs * 0)
        if HAS_SCALE:  # a fused optimizer's grad_scale: grad /= (double)*grad_scale
            grad = (grad.to(tl.float64) / tl.load(scale_ptr + offs * 0).to(tl.float64)).to(tl.float32)
        param = tl.load(master_ptr + offs, mask=mask, other=0.0)
        exp_avg = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
        # doubles, each passed as two floats (kernel float arguments are FP32)
        lr, wd = (
            (tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)),
            (tl.cast(wd_hi, tl.float64) + tl.cast(wd_lo, tl.float64)),
        )
        beta1, beta2 = (
            (tl.cast(beta1_hi, tl.float64) + tl.cast(beta1_lo, tl.float64)),
            (tl.cast(beta2_hi, tl.float64) + tl.cast(beta2_lo, tl.float64)),
        )
        if STEP_ON_DEVICE:  # (lr / bias correction 1, sqrt(bias correction 2)) made from the device counter
            step_size = tl.load(step_ptr + offs * 0)
            bc2_sqrt = tl.load(step_ptr + 1 + offs * 0)
        else:
            step_size = tl.cast(step_size_host, tl.float32)
            bc2_sqrt = tl.cast(bc2_sqrt_host, tl.float32)
        if HAS_WD:
            if DECOUPLED:
                param = (param.to(tl.float64) - lr * wd * param.to(tl.float64)).to(tl.float32)
            else:
                grad = (grad.to(tl.float64) + param.to(tl.float64) * wd).to(tl.float32)
        g64 = grad.to(tl.float64)
        exp_avg = (beta1 * exp_avg.to(tl.float64) + (1 - beta1) * g64).to(tl.float32)
        exp_avg_sq = (beta2 * exp_avg_sq.to(tl.float64) + (1 - beta2) * g64 * g64).to(tl.float32)
        # sqrt(v) / sqrt(bias correction 2) in FP32, then + eps in double
        eps = tl.cast(eps_hi, tl.float64) + tl.cast(eps_lo, tl.float64)
        denom = (tl.div_rn(tl.sqrt_rn(exp_avg_sq), bc2_sqrt).to(tl.float64) + eps).to(tl.float32)
        param = param - tl.div_rn(step_size * exp_avg, denom)  # IEEE division, as CUDA's `/`
        tl.store(master_ptr + offs, param, mask=mask)
        tl.store(exp_avg_ptr + offs, exp_avg, mask=mask)
        tl.store(exp_avg_sq_ptr + offs, exp_avg_sq, mask=mask)
        tl.store(weight_ptr + offs, param.to(tl.float16), mask=mask)

    return master_adam


def run_one_pass(
    optimizer: torch.optim.Optimizer,
    group: dict,
    slots: list[OnePassSlot],
    state_of: Any,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """The group's Adam/AdamW update of `slots`, one kernel launch per parameter. `state_of(key)` gives
    the optimizer's state for a key (created as Adam creates it). Step counters move as torch's fused
    optimizer moves them: +1, and back on a step `found_inf` skips (on the device)."""
    import triton

    kernel = _kernel()
    beta1, beta2 = group["betas"]
    lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    decoupled = group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW)
    states = [state_of(s.key) for s in slots]
    steps = [st["step"] for st in states]
    with torch.no_grad():
        torch._foreach_add_(steps, 1)
        # A counter on the device (fused or capturable): the bias corrections in double there, as
        # torch's fused kernel takes them (a few kernels for the whole group, no host read).
        on_device = [_counter_on_device(step, slot.master) for slot, step in zip(slots, steps, strict=True)]
        device_steps = [step for step, d in zip(steps, on_device, strict=True) if d]
        corrections = iter(())
        if device_steps:
            count = torch.stack(device_steps).double()
            # in double, passed on as FP32 (torch's kernel takes them as opmath_t)
            step_sizes = (lr / (1 - torch.pow(beta1, count)).float().double()).float()
            bc2_sqrts = torch.sqrt(1 - torch.pow(beta2, count)).float()
            corrections = iter(torch.stack([step_sizes, bc2_sqrts], dim=1))  # a (step size, sqrt) pair each
        hyper = [*_split(lr), *_split(beta1), *_split(beta2), *_split(eps), *_split(wd)]
        for slot, state, step, here in zip(slots, states, steps, on_device, strict=True):
            dummy = slot.master  # an unused pointer argument
            pair = next(corrections) if here else dummy
            step_size, bc2_sqrt = 0.0, 0.0
            if not here:  # a CPU counter (for-loop or foreach, not capturable): the same, on the host
                k = float(step)
                step_size = _fp32(lr / _fp32(1 - beta1**k))
                bc2_sqrt = _fp32((1 - beta2**k) ** 0.5)
            n = slot.master.numel()
            kernel[(triton.cdiv(n, BLOCK),)](
                slot.grad, slot.factor if slot.factor is not None else dummy,
                grad_scale if grad_scale is not None else dummy,
                found_inf if found_inf is not None else dummy,
                pair, slot.master, state["exp_avg"], state["exp_avg_sq"], slot.weight, n,
                *hyper, step_size, bc2_sqrt,
                HAS_FACTOR=slot.factor is not None, HAS_SCALE=grad_scale is not None,
                HAS_INF=found_inf is not None, HAS_WD=wd != 0, STEP_ON_DEVICE=here, DECOUPLED=decoupled,
                BLOCK=BLOCK,
            )  # fmt: skip
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf.to(steps[0].device)] * len(steps))
