"""Where gradients sit on the FP16 number line: exponent histograms computed on the device.

Buckets (`BUCKETS`): `zero`; `<2^-24` (nonzero but below FP16's smallest subnormal: flushed to
zero in FP16); one bucket per power of two from `2^-24` to `2^15` (`2^-24`..`2^-15` are FP16's
subnormals, `2^-14`..`2^15` its normal range); `>=2^16` (overflows FP16: its largest value is
65504); `inf/nan`. Counting is a few elementwise kernels and an `index_add_` per tensor, with no
host synchronisation: figures are read (one sync) only when `GradientTelemetry.read()` is called,
which the Trainer does at log steps.

Under autocast the *parameter* gradients are FP32: what FP16 flushed in the backward pass is
already an exact zero there, indistinguishable from a structural zero. What was lost is measured by
`measure_flushed_fraction` (an FP32 reference pass) and by `ActivationGradientProbe` (the FP16
activation gradients, where the flushing happens).
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .module_hooks import ModuleHooks

__all__ = [
    "BUCKETS",
    "FP16_MAX",
    "bucket_counts",
    "summarize_counts",
    "module_key",
    "GradientTelemetry",
    "ActivationGradientProbe",
]

FP16_MAX = 65504.0
MIN_EXP, MAX_EXP = -24, 15  # FP16's smallest subnormal 2^-24; largest binade 2^15
BUCKETS = ["zero", "<2^-24", *(f"2^{e}" for e in range(MIN_EXP, MAX_EXP + 1)), ">=2^16", "inf/nan"]
N_BUCKETS = len(BUCKETS)
_ZERO, _BELOW, _OVER, _NONFINITE = 0, 1, N_BUCKETS - 2, N_BUCKETS - 1
_SUBNORMAL_LIMIT = 2.0**-14  # below it FP16 is subnormal (fewer significant bits) or zero


def bucket_index(exponent: int) -> int:
    """The bucket of values in `[2^exponent, 2^(exponent+1))`."""
    return min(max(exponent, MIN_EXP - 1), MAX_EXP + 1) - MIN_EXP + 2


_CHUNK = 2**24  # float32 counts are exact up to 2^24: histc runs in chunks no larger


def _fold_table(device: torch.device) -> torch.Tensor:
    """FP32 biased exponent (0..255) -> bucket. 0 (zero or an FP32 subnormal) goes to `<2^-24`;
    zeros are moved to `zero` by a separate count. Built on `device` by device ops (no host-to-device
    copy: on CUDA that is a synchronising copy, and inside a CUDA-graph capture a copy whose source is
    gone at replay), once per device."""
    table = _FOLD.get(device)
    if table is None:
        biased = torch.arange(256, device=device)
        table = (biased - 127).clamp(MIN_EXP - 1, MAX_EXP + 1) - MIN_EXP + 2  # bucket_index(biased - 127)
        table = torch.where(biased == 0, _BELOW, torch.where(biased == 255, _NONFINITE, table))
        _FOLD[device] = table
    return table


_FOLD: dict[torch.device, torch.Tensor] = {}


def bucket_counts(tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Histogram of `tensor`'s elements over `BUCKETS` (int64, on the tensor's device), added to
    `out` if given. It histograms the 8-bit FP32 exponent field (256 bins), folds it into the
    buckets and counts zeros separately: no host synchronisation (on CUDA `histc` with fixed bounds,
    not `bincount`, which reads the maximum back to the host)."""
    x = tensor.detach().reshape(-1)
    x = (x if x.dtype == torch.float32 else x.float()).contiguous()
    if out is None:
        out = torch.zeros(N_BUCKETS, dtype=torch.int64, device=x.device)
    if x.device.type == "cpu" and sys.byteorder == "little":
        # The exponent from the two high bytes as uint8: a quarter of the int32 path's memory traffic.
        high = x.view(torch.uint8).view(-1, 4)
        per_exponent = torch.bincount((high[:, 3] << 1) | (high[:, 2] >> 7), minlength=256)
    elif x.device.type == "cpu":
        per_exponent = torch.bincount(((x.view(torch.int32) >> 23) & 0xFF).to(torch.uint8), minlength=256)
    else:
        biased = (x.view(torch.int32) >> 23) & 0xFF
        per_exponent = torch.zeros(256, dtype=torch.int64, device=x.device)
        for chunk in biased.split(_CHUNK):
            per_exponent += torch.histc(chunk.float(), bins=256, min=-0.5, max=255.5).to(torch.int64)
    out.index_add_(0, _fold_table(x.device), per_exponent)
    zeros = x.numel() - torch.count_nonzero(x)
    out[_ZERO] += zeros
    out[_BELOW] -= zeros
    return out


def _finite_amax(tensor: torch.Tensor) -> torch.Tensor:
    """max |x| in one read-only pass; inf or NaN when the tensor holds one (no headroom left)."""
    x = tensor.detach().reshape(-1)
    if x.numel() == 0:
        return torch.zeros((), device=x.device)
    low, high = torch.aminmax(x.float() if x.dtype != torch.float32 else x)
    return torch.maximum(low.abs(), high.abs())


def summarize_counts(
    counts: list[int] | torch.Tensor, amax: float | None = None, untouched: int | None = None
) -> dict[str, Any]:
    """Fractions from a histogram: zero, subnormal (0 < |x| < 2^-14, including below 2^-24),
    below 2^-24 (flushed in FP16), overflow (>= 2^16 or inf/NaN), and headroom in bits,
    `log2(65504 / max|x|)` (negative: the largest value overflows FP16; -inf: inf/NaN present).

    With `untouched` (elements in gradient rows that are zero throughout, see
    `untouched_elements`): `untouched_frac`, and `touched_zero_frac`, the zeros in rows that did
    receive a gradient -- where underflow shows; `zero_frac` is their sum."""
    counts = [int(c) for c in counts]
    total = max(sum(counts), 1)
    subnormal_buckets = [_BELOW, *range(bucket_index(MIN_EXP), bucket_index(-14))]
    out = {
        "total": sum(counts),
        "zero_frac": counts[_ZERO] / total,
        "subnormal_frac": sum(counts[i] for i in subnormal_buckets) / total,
        "below_fp16_frac": counts[_BELOW] / total,
        "overflow_frac": (counts[_OVER] + counts[_NONFINITE]) / total,
        "counts": counts,
    }
    if untouched is not None:
        out["untouched_frac"] = int(untouched) / total
        out["touched_zero_frac"] = (counts[_ZERO] - int(untouched)) / total
    if amax is not None:
        out["max_abs"] = amax
        if not math.isfinite(amax):
            out["headroom_bits"] = -math.inf  # the step held inf/NaN: it overflowed
        else:
            out["headroom_bits"] = math.log2(FP16_MAX / amax) if amax > 0 else math.inf
    return out


def untouched_elements(tensor: torch.Tensor) -> torch.Tensor:
    """Elements of `tensor` in rows (slices along dim 0; the whole tensor when it has fewer than two
    dims) that are zero throughout: an embedding row whose token was not in the batch, a parameter
    the forward did not use. Such zeros say nothing about underflow. (A row that FP16 flushed in its
    entirety counts here too; single flushed elements among nonzero ones do not.) A 0-d tensor on
    the device: no sync."""
    x = tensor.detach()
    if x.numel() == 0:  # an empty tensor (a rank's empty FSDP2 shard) has no rows to count
        return torch.zeros((), dtype=torch.int64, device=x.device)
    rows = x.reshape(x.shape[0], -1) if x.dim() >= 2 else x.reshape(1, -1)
    return (torch.count_nonzero(rows, dim=1) == 0).sum() * rows.shape[1]


_INDEX = re.compile(r"^\d+$")


def module_key(parameter_name: str, depth: int = 2) -> str:
    """The module a parameter is reported under: its path up to the first numbered block
    (`bert.encoder.layer.3`), else its first `depth` components of the owning module
    (`bert.embeddings`, `classifier`)."""
    parts = parameter_name.split(".")[:-1] or parameter_name.split(".")
    for i, part in enumerate(parts):
        if _INDEX.match(part):
            return ".".join(parts[: i + 1])
    return ".".join(parts[:depth])


class GradientTelemetry:
    """Exponent histograms of the scaled parameter gradients, per model and per module, on the
    device, every `interval` optimizer iterations. `DynamicLossScaler` feeds it (just before it
    unscales or hands the gradients to a fused optimizer); `read()` returns the last snapshot
    (one host sync) and is called at log steps.

    Args:
        interval (`int`): observe every `interval`-th iteration (0 disables).
    """

    def __init__(self, interval: int) -> None:
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
            raise ValueError(f"telemetry_interval={interval!r} must be an integer >= 0 (0 disables).")
        self.interval = interval
        self._pending: dict[str, list[torch.Tensor]] = {}
        self._pending_step: int | None = None
        self._last: tuple[int, dict[str, list[torch.Tensor]]] | None = None
        self._read_step: int | None = None

    def due(self, iteration: int) -> bool:
        return self.interval > 0 and iteration % self.interval == 0

    def observe(self, named_tensors: Iterable[tuple[str, torch.Tensor]], iteration: int) -> None:
        """Add tensors (already scaled gradients) to this iteration's histograms. No sync."""
        if self._pending_step != iteration:
            self._pending, self._pending_step = {}, iteration
        for name, grad in named_tensors:
            key = module_key(name)
            if key not in self._pending:
                zeros = torch.zeros(N_BUCKETS, dtype=torch.int64, device=grad.device)
                untouched = torch.zeros((), dtype=torch.int64, device=grad.device)
                self._pending[key] = [zeros, torch.zeros((), device=grad.device), untouched]
            counts, amax, untouched = self._pending[key]
            bucket_counts(grad, out=counts)
            torch.maximum(amax, _finite_amax(grad).to(amax.device), out=amax)
            untouched += untouched_elements(grad).to(untouched.device)

    def end_iteration(self, iteration: int) -> None:
        """Close the iteration's snapshot (the scaler calls it from `update()`)."""
        if self._pending_step == iteration and self._pending:
            self._last = (iteration, self._pending)
            self._pending, self._pending_step = {}, None

    def read(self, only_new: bool = False) -> dict[str, Any] | None:
        """The last snapshot as Python values (one host sync): `step` (the iteration it was measured
        at), the model's `summarize_counts` figures (with `untouched_frac` and `touched_zero_frac`),
        and `per_module`. `only_new=True`: None if already read."""
        if self._last is None or (only_new and self._read_step == self._last[0]):
            return None
        step, modules = self._last
        self._read_step = step
        host = {k: (c.tolist(), float(a), int(u)) for k, (c, a, u) in modules.items()}
        total = [sum(col) for col in zip(*(c for c, _, _ in host.values()), strict=True)]
        out = summarize_counts(
            total, max(a for _, a, _ in host.values()), sum(u for _, _, u in host.values())
        )
        out["step"] = step
        out["per_module"] = {k: summarize_counts(c, a, u) for k, (c, a, u) in host.items()}
        return out


class ActivationGradientProbe:
    """Opt-in: exponent histograms of the gradients flowing out of module boundaries during
    backward (under autocast these are FP16: where underflow really happens), sampled.

    Hooks the modules whose qualified name is a `module_key` of the model's parameters (e.g. each
    `bert.encoder.layer.N`, `bert.embeddings`, `classifier`) with a forward hook that registers a
    tensor hook on the output; records only while `active` is true, at most `sample` elements per
    tensor (a strided view). `lost_frac` = fraction of sampled elements that are zero or below
    2^-24 (on FP16 runs flushed values are already zero, so structural zeros count too; an FP32
    pass, as `hf-lossscale advise` runs, tells them apart). `on_gradient(name, grad)`, when given,
    receives each gradient instead (the histograms stay empty): `advise` keeps FP32 samples that way.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        sample: int = 4096,
        on_gradient: Callable[[str, torch.Tensor], None] | None = None,
    ) -> None:
        self.sample = sample
        self.on_gradient = on_gradient
        self.active = False
        keys = {module_key(n) for n, p in model.named_parameters() if p.requires_grad}
        self.counts: dict[str, torch.Tensor] = {}
        self.amax: dict[str, torch.Tensor] = {}
        self._hooks = ModuleHooks(model, forward=self._after_forward, where=keys.__contains__)

    def _after_forward(self, name: str, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.active or not torch.is_grad_enabled():
            return
        tensor = _first_output_tensor(output)
        if tensor is not None and tensor.requires_grad:
            record = self.on_gradient or self._record
            tensor.register_hook(lambda grad: record(name, grad))

    def _record(self, name: str, grad: torch.Tensor) -> None:
        flat = grad.detach().reshape(-1)
        stride = max(1, flat.numel() // self.sample)
        sampled = flat[::stride]
        if name not in self.counts:
            self.counts[name] = torch.zeros(N_BUCKETS, dtype=torch.int64, device=grad.device)
            self.amax[name] = torch.zeros((), device=grad.device)
        bucket_counts(sampled, out=self.counts[name])
        torch.maximum(self.amax[name], _finite_amax(sampled), out=self.amax[name])

    def read(self, reset: bool = True) -> dict[str, Any]:
        """Per module and overall figures (one host sync); `lost_frac` as described above."""
        host = {k: (c.tolist(), float(self.amax[k])) for k, c in self.counts.items()}
        if reset:
            self.counts, self.amax = {}, {}
        per_module = {}
        for k, (c, a) in host.items():
            s = summarize_counts(c, a)
            s["lost_frac"] = (c[_ZERO] + c[_BELOW]) / max(sum(c), 1)
            per_module[k] = s
        total = (
            [sum(col) for col in zip(*(c for c, _ in host.values()), strict=True)]
            if host
            else [0] * N_BUCKETS
        )
        out = summarize_counts(total, max((a for _, a in host.values()), default=0.0))
        out["lost_frac"] = (total[_ZERO] + total[_BELOW]) / max(sum(total), 1)
        out["per_module"] = per_module
        return out

    def remove(self) -> None:
        self._hooks.remove()


def _first_output_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):  # ModelOutput
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor):
                return item
    return None
