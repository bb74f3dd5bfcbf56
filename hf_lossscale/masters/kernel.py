"""One pass over memory for the FP32-master Adam/AdamW step on CUDA (issue 49): a Triton kernel,
launched once for a parameter group (issue 56), as Apex's and Transformer Engine's FusedAdam are.

For each FP16 parameter the kernel reads its FP16 gradient once, and in the same pass multiplies it
by the unscale (and clip) factor, divides it by a fused optimizer's `grad_scale`, runs Adam or AdamW on
the FP32 master and moments (torch's fused arithmetic), and writes the master, the moments and the
FP16 weight. A step whose `found_inf` is set writes nothing. Everything it reads is on the device (the
factor, `grad_scale`, `found_inf`, the step counter of a fused or capturable group), so it adds no
host sync.

One launch covers the group (two over one table when it mixes tensors whose addresses are all 16-byte
aligned with others: the aligned tensors' launch tells the compiler, which then moves whole blocks in
vectors): a table on the device holds each tensor's addresses and length, another each program's
(tensor, first element) pair, `CHUNK` elements per program (what Apex's
`multi_tensor_apply` hands a CUDA block). The tables are made on the host and copied once (pinned,
without waiting); a step over the same tensors (the same addresses: the masters, moments and weights
stay put, and a gradient the allocator hands the same block) reuses them, copying nothing. While a
CUDA graph is being captured the kernel does not run (`run_one_pass` returns False and the chunked
update, torch's capturable kernels, steps): a table copy would read host memory at replay, a kept
table may be dropped while the graph still points at it, and the per-step factor is a new tensor
each step, so a table made before the capture would not match anyway.

Reading the gradient once more than this is not avoidable: whether a step is skipped (and the clip's
norm) depends on every gradient, so the scaler's read-only check (`grad_pass.check_`, the FP16
gradients as they are, or `_foreach_norm` for the clip) comes before any write.

It runs where Triton is importable and the parameters are on CUDA (torch's CUDA wheels ship Triton);
elsewhere the chunked update of `masters.step` runs, bitwise torch's optimizer. `TRITON_INTERPRET=1`
runs the kernel on a CPU (slowly), which is how its tests check it against torch's AdamW without a GPU
(`make test-kernel`).
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from . import cpu_kernel

__all__ = ["OnePassSlot", "one_pass_reason", "run_one_pass", "triton_available"]

#: Elements per loop iteration of a program, and per program (a program loops over its chunk).
BLOCK = 1024
CHUNK = 1 << 16
#: Warps per program (4 warps put 8 elements in a thread, so its 16-byte FP16 load and 16-byte FP32
#: stores need different layouts, converted through shared memory every block, and 142 registers; 8
#: warps: 4 elements, no conversion in the loop, 80 registers, from the sm_90a build).
NUM_WARPS = 8
#: The columns of the tensor table: each tensor's addresses (the FP16 gradient, its FP32 factor, the
#: FP32 master, both moments, the FP16 weight) and its length.
_COLUMNS = 7
#: Tables kept per optimizer (a few address sets: gradients the allocator hands different blocks).
_KEPT = 4


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
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        return "not Adam, AdamW or SGD"
    if group.get("differentiable"):
        return "differentiable=True"
    if torch.is_tensor(group["lr"]):
        return "a tensor learning rate"
    devices = {s.master.device for s in slots}
    if len(devices) > 1:
        return "parameters on several devices"
    device = next(iter(devices), torch.device("cpu"))
    on_cpu = device.type == "cpu" and not _interpreting()
    sgd = type(optimizer) is torch.optim.SGD
    if sgd and not on_cpu:
        return "SGD off a CPU (the CUDA kernel computes Adam and AdamW)"
    if not on_cpu and (group["amsgrad"] or group["maximize"]):
        return "amsgrad or maximize (the CUDA kernel computes neither)"
    for s in slots:
        if s.grad.dtype != torch.float16 or s.master.dtype != torch.float32:
            return "not an FP16 gradient with an FP32 master"
        if s.factor is not None and (s.factor.dtype != torch.float32 or s.factor.numel() != 1):
            return "a factor that is not one FP32 number"
        if s.weight.dtype != torch.float16:
            return "not an FP16 weight"
        if not (s.grad.is_contiguous() and s.master.is_contiguous() and s.weight.is_contiguous()):
            return "a non-contiguous tensor"
    if on_cpu:  # `cpu_adam.c`: torch's fused Adam/AdamW arithmetic, and its for-loop/foreach SGD
        if sgd and group["fused"]:
            return "SGD with fused=True on a CPU (the CPU kernel computes its for-loop/foreach arithmetic)"
        if not sgd and not group["fused"]:
            return "Adam/AdamW on a CPU, not fused=True (the CPU kernel computes torch's fused arithmetic)"
        if not sgd and any(torch.is_tensor(b) for b in group["betas"]):
            return "tensor betas"
        return cpu_kernel.reason()
    if device.type != "cuda" and not _interpreting():
        return f"not on CUDA or a CPU ({device.type})"
    if not triton_available():
        return "Triton is not installed"
    return None


def _aligned(slot: OnePassSlot, state: dict) -> bool:
    """Whether every address the kernel moves in blocks is 16-byte aligned: then its launch tells the
    compiler so, and whole blocks load and store in vectors (blocks start at multiples of BLOCK
    elements, so the first element's alignment is every block's)."""
    tensors = (slot.grad, slot.master, state["exp_avg"], state["exp_avg_sq"], slot.weight)
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _counter_on_device(step: torch.Tensor, master: torch.Tensor) -> bool:
    """Whether a step counter lives beside its master (fused or capturable groups), not on the host."""
    return step.device == master.device


def _capturing(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _fp32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _split(x: float) -> tuple[float, float]:
    """A double as the sum of two FP32 numbers (the kernel widens them back)."""
    hi = float(torch.tensor(x, dtype=torch.float32))
    return hi, float(torch.tensor(x - hi, dtype=torch.float32))


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on the device without waiting for it: from pinned memory (torch's host allocator
    keeps the block until the copy is done) on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class _Kept(NamedTuple):
    """A group's tables and how its launches cut them: the tensors in `order` (indices into the group's
    slots, the `aligned` ones with every block address 16-byte aligned first), whose first `split` of
    `count` programs are the aligned tensors'."""

    table: torch.Tensor
    programs: torch.Tensor
    count: int
    order: tuple[int, ...]
    aligned: int
    split: int


class _Tables:
    """The launch's tables per address set, kept on the optimizer's side (weakly: they die with it)."""

    _of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def get(cls, optimizer: torch.optim.Optimizer, slots: list[OnePassSlot], states: list[dict]) -> _Kept:
        """The tables for `slots`, kept or made. Addresses and lengths are all a table holds (the
        alignment and the order follow from the addresses): a new tensor at a kept address with the
        same length is the same to the kernel."""
        device = slots[0].master.device
        kept = cls._of.setdefault(optimizer, {})
        ones = kept.get(("ones", device))
        if ones is None:
            ones = kept[("ones", device)] = torch.ones((), dtype=torch.float32, device=device)
        rows = [
            (s.grad.data_ptr(), (s.factor if s.factor is not None else ones).data_ptr(), s.master.data_ptr(),
             st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr(), s.weight.data_ptr(), s.master.numel())
            for s, st in zip(slots, states, strict=True)
        ]  # fmt: skip
        key = (device, CHUNK, tuple(rows))  # the program table is cut at this CHUNK
        found = kept.get(key)
        if found is not None:
            return found
        aligned = [_aligned(slot, st) for slot, st in zip(slots, states, strict=True)]
        order = sorted(range(len(rows)), key=lambda i: not aligned[i])  # (stable: the group's order within)
        rows = [rows[i] for i in order]
        programs = [(t, start) for t, row in enumerate(rows) for start in range(0, row[-1], CHUNK)]
        found = _Kept(
            _to_device([v for row in rows for v in row], torch.int64, device),
            _to_device([v for p in programs for v in p], torch.int64, device),
            len(programs),
            tuple(order),
            sum(aligned),
            sum(-(-row[-1] // CHUNK) for row in rows[: sum(aligned)]),
        )
        tables = [k for k in kept if k[0] != "ones"]
        if len(tables) >= _KEPT:
            del kept[tables[0]]  # the oldest
        kept[key] = found
        return found


@functools.cache
def _kernel() -> Any:
    from . import triton_adam  # Triton is imported only where the kernel runs

    return triton_adam.master_adam


def _corrections(
    steps: list[torch.Tensor],
    on_device: list[bool],
    lr: float,
    beta1: float,
    beta2: float,
    device: torch.device,
) -> torch.Tensor:
    """Each tensor's (lr / bias correction 1, sqrt(bias correction 2)) in FP32 on the device, as torch's
    fused kernel takes them: a counter on the device computes them there in double (a few kernels for
    the group, no host read); a counter on the host (for-loop or foreach, not capturable) on the host."""
    rows: list[torch.Tensor | None] = [None] * len(steps)
    device_steps = [i for i, d in enumerate(on_device) if d]
    if device_steps:
        count = torch.stack([steps[i] for i in device_steps]).double()
        step_sizes = (lr / (1 - torch.pow(beta1, count)).float().double()).float()
        bc2_sqrts = torch.sqrt(1 - torch.pow(beta2, count)).float()
        if len(device_steps) == len(steps):
            return torch.stack([step_sizes, bc2_sqrts], dim=1)
        for j, i in enumerate(device_steps):
            rows[i] = torch.stack([step_sizes[j], bc2_sqrts[j]])
    host = []
    for i, step in enumerate(steps):
        if not on_device[i]:
            k = float(step)
            host.append([_fp32(lr / _fp32(1 - beta1**k)), _fp32((1 - beta2**k) ** 0.5)])
    host_rows = iter(_to_device(host, torch.float32, device)) if host else iter(())
    return torch.stack([row if row is not None else next(host_rows) for row in rows])


def run_one_pass(
    optimizer: torch.optim.Optimizer,
    group: dict,
    slots: list[OnePassSlot],
    state_of: Any,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> bool:
    """The group's Adam/AdamW update of `slots` in one kernel launch (two over the same tables when
    aligned and unaligned tensors mix). `state_of(key)` gives the
    optimizer's state for a key (created as Adam creates it). Step counters move as torch's fused
    optimizer moves them: +1, and back on a step `found_inf` skips (on the device). False, with nothing
    done (the caller then takes the chunked update): while a CUDA graph is being captured on the
    parameters' device; with `found_inf` when a step counter is on the host (taking it back would read
    the flag on the host); when a moment is not a contiguous FP32 tensor of its master's shape on its
    master's device (the kernel reads it flat, as the master)."""

    if not slots:
        return True
    device = slots[0].master.device
    if device.type == "cpu" and not _interpreting():
        return cpu_kernel.step(optimizer, group, slots, state_of, grad_scale, found_inf)
    if _capturing(device):
        return False
    states = [state_of(s.key) for s in slots]
    steps = [st["step"] for st in states]
    on_device = [_counter_on_device(step, slot.master) for slot, step in zip(slots, steps, strict=True)]
    moments = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")
    if not all(
        cpu_kernel.fp32_like(st[name], s.master)
        for s, st in zip(slots, states, strict=True)
        for name in moments
    ):
        return False
    if found_inf is not None and not all(on_device):
        return False  # a counter on the host cannot take a device flag back without a sync: torch's path
    if CHUNK % BLOCK:
        raise ValueError(f"masters.kernel: CHUNK ({CHUNK}) must be a multiple of BLOCK ({BLOCK})")
    beta1, beta2 = group["betas"]
    lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    decoupled = group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW)
    # the aligned tensors first in one table: a launch for their programs, another for the rest's
    kept = _Tables.get(optimizer, slots, states)
    with torch.no_grad():
        torch._foreach_add_(steps, 1)
        if kept.count:  # (every tensor empty: nothing to launch, and a grid of 0 programs is an error)
            order = kept.order
            corrections = _corrections(
                [steps[i] for i in order],
                [on_device[i] for i in order],
                lr,
                float(beta1),
                float(beta2),
                device,
            )
            dummy = corrections  # an unused pointer argument
            ordered = [slots[i] for i in order]
            for is_aligned, first, n, part in (
                (True, 0, kept.split, ordered[: kept.aligned]),
                (False, kept.split, kept.count - kept.split, ordered[kept.aligned :]),
            ):
                if not n:
                    continue
                _kernel()[(n,)](
                    kept.table, kept.programs,
                    grad_scale if grad_scale is not None else dummy,
                    found_inf if found_inf is not None else dummy,
                    corrections, first,
                    *_split(lr), *_split(beta1), *_split(beta2), *_split(eps), *_split(wd),
                    HAS_FACTOR=any(s.factor is not None for s in part), HAS_SCALE=grad_scale is not None,
                    HAS_INF=found_inf is not None, HAS_WD=wd != 0, DECOUPLED=decoupled, ALIGNED=is_aligned,
                    COLUMNS=_COLUMNS, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=NUM_WARPS,
                    enable_fp_fusion=True,  # nvcc's default (--fmad=true), as torch's fused kernel is built
                )  # fmt: skip
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf.to(device)] * len(steps))
    cpu_kernel.mark_written(slots, states, ("exp_avg", "exp_avg_sq"))  # (written through their addresses)
    return True
