"""The optimizer's own update for FP16 parameters, run chunk by chunk (issue 49).

torch's Adam, AdamW and SGD are elementwise: each element of a parameter is updated from the same
elements of its gradient and state. Their functional forms (`torch.optim.adam.adam`,
`torch.optim.sgd.sgd`) take lists of tensors, so they run just as well on chunks (views) of the
parameters, the gradients and the moments. That is what lets a model held in FP16 step without an
FP32 gradient for every parameter at once: each chunk's FP32 gradient is made from the FP16 one
(and the unscale factor) right before the chunk is updated, and freed right after, and the FP16
weights of the chunk are written in the same pass. The arithmetic is torch's, in torch's kernels
(for-loop, foreach or fused, as the parameter group asks), so the result equals torch's
optimizer on FP32 weights bitwise.

Three ways to hold the weight the optimizer updates (`LossScaleConfig.master_weights`):

- `"masters"` (True / "auto"): an FP32 master per parameter, updated in place; the FP16 weight is
  the master rounded to nearest.
- `"kahan"`: the FP16 weight plus an FP16 compensation buffer: the chunk's FP32 weight is their sum,
  and after the update the FP16 weight is its rounding and the buffer what the rounding lost
  (compensated summation: an update below half an FP16 ulp accumulates in the buffer instead of
  being lost). 2 + 2 bytes per parameter instead of 2 + 4.
- `"stochastic_rounding"`: the FP16 weight alone: the updated FP32 chunk is rounded to one of its two
  FP16 neighbours with the probability that makes the rounding unbiased (seeded: a `torch.Generator`
  per device whose state travels in the optimizer's state). 2 bytes per parameter.

Imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.optim.adam import adam as _adam
from torch.optim.sgd import sgd as _sgd

__all__ = [
    "BUCKET_ELEMENTS",
    "UPDATE_BUCKET",
    "Slot",
    "adam_state",
    "chunkable",
    "run_chunked",
    "round_stochastic",
    "kahan_split",
]

#: Elements per bucket of the gradient hand-over (8 MiB of FP32 at a time).
BUCKET_ELEMENTS = 1 << 21
#: The chunked update's buckets: a 64th of the group's elements (so its transients, an FP32 gradient
#: chunk and the kernels' temporaries of the same size, stay a few percent of the model), within these
#: bounds: 2 to 4 MiB of FP32 per call. Below, each call's fixed cost (torch's functional wrapper, the
#: views) outweighs its work: a 2.1M-parameter MLP stepped x2.4 slower than on FP32 weights in 256 KiB
#: buckets, x1.4 in 2 MiB ones. Above, a bucket's working set (the FP32 gradient chunk, the master
#: and both moments) leaves the cache between the cast, the update and the FP16 write
#: (`benchmarks/master_step_ratio.py --bucket`).
UPDATE_BUCKET = (1 << 19, 1 << 20)
#: A tensor is cut at multiples of this many elements: the CPU kernels' vector loops (and CUDA's
#: vectorised loads) then cover the same elements as over the whole tensor, so the result is bitwise
#: the whole tensor's (a cut mid-vector moves elements to the scalar tail, which rounds differently).
ALIGN = 64

_KINDS = {torch.optim.Adam: "adam", torch.optim.AdamW: "adam", torch.optim.SGD: "sgd"}


def chunkable(optimizer: torch.optim.Optimizer, group: dict) -> str | None:
    """None when the group's update can run chunk by chunk here; otherwise why not (in words)."""
    kind = _KINDS.get(type(optimizer))
    if kind is None:
        return f"{type(optimizer).__name__} (chunked updates cover torch's Adam, AdamW and SGD)"
    if group.get("differentiable"):
        return "differentiable=True"
    if group.get("capturable") and not group.get("fused"):
        return "capturable=True without fused=True"
    if kind == "adam" and torch.is_tensor(group.get("lr")):
        return "a tensor learning rate"
    return None


@dataclass(eq=False)
class Slot:
    """One parameter's part of a chunked update: `key` is the parameter the optimizer holds (its state's
    key), `grad_of(a, b)` the chunk's FP32 gradient (unscaled), `load(a, b)` the chunk's FP32 weight (a
    view to update in place, or a temporary), `store(a, b, new)` writes the updated chunk back (the FP16
    weight, the buffer); `numel` the elements, `flat` whether chunks are views of flattened tensors
    (contiguous ones; otherwise the tensor is one chunk). `casts`: `grad_of(a, b, out)` casts the
    chunk's gradient into `out` (FP32, b - a elements) and returns it, so that a flat chunk's cast goes
    into one buffer per step instead of a fresh tensor per chunk (which, with an allocator that returns
    large blocks to the system, faults its pages in anew every time)."""

    key: torch.Tensor
    numel: int
    flat: bool
    grad_of: Callable[..., torch.Tensor]
    load: Callable[[int, int], torch.Tensor]
    store: Callable[[int, int, torch.Tensor], None]
    casts: bool = False


def _scalar_dtype(fused: bool) -> torch.dtype:
    # torch.optim.optimizer._get_scalar_dtype, inlined (a private name)
    return torch.float32 if fused or torch.get_default_dtype() != torch.float64 else torch.float64


def _part(t: torch.Tensor, flat: bool, a: int, b: int) -> torch.Tensor:
    return t.view(-1)[a:b] if flat else t


def adam_state(optimizer: torch.optim.Optimizer, group: dict, key: torch.Tensor) -> dict:
    """The optimizer's state for `key`, created as `Adam._init_group` creates it."""
    state = optimizer.state[key]
    if len(state) == 0:  # as Adam._init_group
        fused, capturable = bool(group["fused"]), bool(group["capturable"])
        state["step"] = (
            torch.zeros((), dtype=_scalar_dtype(fused), device=key.device)
            if capturable or fused
            else torch.tensor(0.0, dtype=_scalar_dtype(False), device="cpu")
        )
        state["exp_avg"] = torch.zeros(key.shape, dtype=torch.float32, device=key.device)
        state["exp_avg_sq"] = torch.zeros(key.shape, dtype=torch.float32, device=key.device)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros(key.shape, dtype=torch.float32, device=key.device)
    return state


def _buckets(slots: list[Slot], size: int) -> list[list[tuple[Slot, int, int]]]:
    """(slot, start, end) chunks packed into buckets of at most `size` elements (a tensor that cannot be
    cut is one chunk, alone if larger)."""
    buckets: list[list[tuple[Slot, int, int]]] = [[]]
    room = size
    for slot in slots:
        if not slot.flat:
            if buckets[-1] and slot.numel > room:
                buckets.append([])
                room = size
            buckets[-1].append((slot, 0, slot.numel))
            room -= slot.numel
            continue
        start = 0
        while start < slot.numel:
            if room < ALIGN and slot.numel - start > room:
                buckets.append([])
                room = max(size, ALIGN)
            # the cut at a multiple of ALIGN (or the tensor's end)
            end = min(slot.numel, start + room // ALIGN * ALIGN) if slot.numel - start > room else slot.numel
            buckets[-1].append((slot, start, end))
            room -= end - start
            start = end
    return [b for b in buckets if b]


def run_chunked(
    optimizer: torch.optim.Optimizer,
    group: dict,
    slots: list[Slot],
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    bucket: int | None = None,
) -> None:
    """The group's update of `slots`, bucket by bucket, with torch's functional kernels (the group's
    for-loop / foreach / fused choice, and `grad_scale`/`found_inf` as the scaler hands them to a fused
    optimizer). Each parameter's step counter moves once."""
    if not slots:
        return
    if bucket is None:
        low, high = UPDATE_BUCKET
        bucket = min(high, max(low, sum(s.numel for s in slots) // 64))
    kind = _KINDS[type(optimizer)]
    if kind == "adam":
        states = {id(s.key): adam_state(optimizer, group, s.key) for s in slots}
    else:
        states = {id(s.key): optimizer.state[s.key] for s in slots} if group["momentum"] != 0 else {}
    new_buffers: dict[int, torch.Tensor] = {}  # SGD's first step: full momentum buffers, filled per chunk
    scratch = _Scratch(slots[0].key.device)
    counters = _fused_counters(group, kind, states, grad_scale, found_inf)
    with torch.no_grad():
        if counters is not None:  # each counter moves once, before the buckets read it
            torch._foreach_add_(counters, 1)
        for chunks in _buckets(slots, bucket):
            if kind == "sgd" and group["momentum"] != 0 and group["fused"]:
                # torch's fused SGD reads "first step" off the first buffer: one kind per call
                first = [c for c in chunks if "momentum_buffer" not in states[id(c[0].key)]]
                rest = [c for c in chunks if "momentum_buffer" in states[id(c[0].key)]]
                parts = [p for p in (first, rest) if p]
            else:
                parts = [chunks]
            for part in parts:
                _run_part(
                    optimizer, group, kind, part, states, new_buffers, grad_scale, found_inf, scratch,
                    counters is not None,
                )  # fmt: skip
        if counters is not None and found_inf is not None:  # a skipped step: as torch's fused Adam, back
            torch._foreach_sub_(counters, [found_inf] * len(counters))
    for key_id, buf in new_buffers.items():
        states[key_id]["momentum_buffer"] = buf


class _Scratch:
    """What a step keeps across its buckets: one FP32 buffer for the chunks' gradients, grown to the
    largest part it serves, and the state tensors' flat views (made once, not per chunk)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.buffer = device, None
        self.flats: dict[int, torch.Tensor] = {}

    def part(self, t: torch.Tensor, flat: bool, a: int, b: int) -> torch.Tensor:
        """`_part(t, flat, a, b)`, on a flat view of `t` kept for the step."""
        if not flat:
            return t
        whole = self.flats.get(id(t))
        if whole is None:
            whole = self.flats[id(t)] = t.view(-1)
        return whole[a:b]

    def grads(self, chunks: list[tuple[Slot, int, int]]) -> list[torch.Tensor]:
        buffered = [slot.flat and slot.casts for slot, _, _ in chunks]
        need = sum(b - a for (_, a, b), into in zip(chunks, buffered, strict=True) if into)
        if need and (self.buffer is None or self.buffer.numel() < need):
            self.buffer = torch.empty(need, dtype=torch.float32, device=self.device)
        grads, at = [], 0
        for (slot, a, b), into in zip(chunks, buffered, strict=True):
            if into:
                grads.append(slot.grad_of(a, b, self.buffer[at : at + b - a]))
                at += b - a
            else:
                grads.append(slot.grad_of(a, b))
        return grads


def _fused_counters(
    group: dict,
    kind: str,
    states: dict[int, dict],
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> list[torch.Tensor] | None:
    """The step counters of a fused Adam/AdamW group whose buckets call torch's fused kernel directly, as
    torch's `_fused_adam` calls it, on counters moved once for the whole step; None where they go through
    torch's functional `adam()` (not fused, tensor betas, or tensors on more than one device). That
    functional form checks and groups its arguments and moves the counters on every call (the counters
    of a tensor's other chunks on copies): with a bucket a 64th of the group, a tenth of the step's time
    on a CPU."""
    if kind != "adam" or not group["fused"] or any(torch.is_tensor(b) for b in group["betas"]):
        return None
    counters = [state["step"] for state in states.values()]
    devices = {t.device for t in counters} | {t.device for t in (grad_scale, found_inf) if t is not None}
    devices |= {state["exp_avg"].device for state in states.values()}
    return counters if len(devices) == 1 else None


def _run_part(
    optimizer: torch.optim.Optimizer,
    group: dict,
    kind: str,
    chunks: list[tuple[Slot, int, int]],
    states: dict[int, dict],
    new_buffers: dict[int, torch.Tensor],
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    scratch: _Scratch,
    counters_moved: bool = False,
) -> None:
    values = [slot.load(a, b) for slot, a, b in chunks]
    grads = scratch.grads(chunks)
    if kind == "adam":

        def parts(key: str) -> list[torch.Tensor]:  # each chunk's view of one state tensor
            return [scratch.part(states[id(slot.key)][key], slot.flat, a, b) for slot, a, b in chunks]

        beta1, beta2 = group["betas"]
    if kind == "adam" and counters_moved:  # see _fused_counters
        decoupled = group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW)
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        kernel(
            values, grads, parts("exp_avg"), parts("exp_avg_sq"), parts("max_exp_avg_sq") if group["amsgrad"] else [],
            [states[id(slot.key)]["step"] for slot, _, _ in chunks], amsgrad=group["amsgrad"], lr=group["lr"],
            beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
            maximize=group["maximize"], grad_scale=grad_scale, found_inf=found_inf,
        )  # fmt: skip
    elif kind == "adam":
        steps = []
        for slot, _, b in chunks:
            real = states[id(slot.key)]["step"]
            # the counter moves once per parameter: at its last chunk; the others count on a copy
            steps.append(real if b == slot.numel else real.clone())
        _adam(
            values,
            grads,
            parts("exp_avg"),
            parts("exp_avg_sq"),
            parts("max_exp_avg_sq") if group["amsgrad"] else [],
            steps,
            amsgrad=group["amsgrad"],
            has_complex=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=False,
            fused=group["fused"],
            grad_scale=grad_scale,
            found_inf=found_inf,
            decoupled_weight_decay=group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW),
        )
    else:
        momentum = group["momentum"] != 0
        buffers: list[torch.Tensor | None] = []
        if momentum:
            for slot, a, b in chunks:
                buf = states[id(slot.key)].get("momentum_buffer")
                buffers.append(None if buf is None else _part(buf, slot.flat, a, b))
        _sgd(
            values,
            grads,
            buffers,
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
            has_sparse_grad=False,
            foreach=group["foreach"],
            fused=group["fused"],
            grad_scale=grad_scale,
            found_inf=found_inf,
        )
        if momentum:
            for (slot, a, b), buf in zip(chunks, buffers, strict=True):
                if "momentum_buffer" in states[id(slot.key)]:
                    continue  # updated in place
                full = new_buffers.get(id(slot.key))
                if full is None:
                    full = new_buffers[id(slot.key)] = torch.empty(
                        slot.key.shape, dtype=torch.float32, device=slot.key.device
                    )
                _part(full, slot.flat, a, b).copy_(buf)
    del grads
    for (slot, a, b), value in zip(chunks, values, strict=True):
        slot.store(a, b, value)


# ---------------------------------------------------------------------- FP16 storage of the weight
def kahan_split(value: torch.Tensor, weight: torch.Tensor, compensation: torch.Tensor) -> None:
    """Write the FP32 `value` as FP16 `weight` (rounded to nearest) + FP16 `compensation` (what the
    rounding lost, rounded)."""
    weight.copy_(value)
    compensation.copy_(value - weight.float())


def round_stochastic(value: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """FP32 `value` rounded to FP16 stochastically: to the FP16 neighbour above or below with the
    probability that makes the rounding unbiased (E[round(x)] = x, to 2^-13 of the spacing), for x
    within FP16's range; beyond it, and for inf and NaN, as round to nearest.

    13 random bits per element (two elements per 32-bit draw of `generator`): in FP16's normal range
    they are added below the 10 mantissa bits FP16 keeps, and the 13 bits cut (a carry reaches the
    next FP16 value with the probability the cut bits give); in its subnormal range (|x| < 2^-14,
    spacing 2^-24) x / 2^-24 is rounded to an integer the same way. No comparison of neighbours."""
    flat = value.contiguous().view(-1)
    n = flat.numel()
    draws = torch.randint(
        0, 1 << 26, ((n + 1) // 2,), generator=generator, device=value.device, dtype=torch.int32
    )
    bits = torch.stack((draws & 0x1FFF, draws >> 13), dim=1).view(-1)[:n]
    normal = ((flat.view(torch.int32) + bits) & ~0x1FFF).view(torch.float32)
    subnormal = torch.floor(flat * 2.0**24 + bits.float() * 2.0**-13) * 2.0**-24
    out = torch.where(flat.abs() < 2.0**-14, subnormal, normal)
    # beyond FP16's largest value (a carry past it, inf, NaN): the value itself, rounded to nearest
    out = torch.where((out.abs() <= 65504.0) & torch.isfinite(flat), out, flat)
    return out.half().view(value.shape)
