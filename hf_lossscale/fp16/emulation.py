"""FP16 numerics at FP32 speed: `fp16_emulation()` and `measure_flushed_fraction()`.

Real FP16 on a CPU is about 20x slower than FP32. Emulation computes in FP32 but rounds every
value that real autocast would hold in FP16 to FP16 precision and range -- forward values and
backward gradients alike -- so underflow to zero below 2^-24, subnormal precision loss and
overflow to inf above 65504 happen at the same places.

How: a `TorchFunctionMode` sees each top-level torch call and applies autocast's op policy:

- ops on the FP16 list (linear, matmul, bmm, baddbmm, addmm, conv, scaled-dot-product
  attention, ...) get their floating inputs rounded to FP16 and produce an output rounded to
  FP16, which is tagged as "virtually FP16";
- ops on the policy's FP32 list run in FP32 and produce untagged FP32 outputs;
- every other op follows its inputs, with torch's promotion rule: tagged FP16 inputs and no
  dimensioned FP32 input give a (rounded, tagged) FP16 output.

A tensor rounded to FP16 also rounds its gradient to FP16 in backward (the gradient of an FP16
tensor is FP16 under autocast): that is where small gradients flush to zero.

Explicit upcasts (`.float()`, `.to(torch.float32)`, as in RMSNorm and softmax upcasts) give
real FP32 tensors; `.T`/`.mT` and device moves keep FP16; 0-d tensors promote as torch promotes
them; in-place ops on an FP16 tensor re-round its values; `out=` calls run in their tensors'
dtypes (they are not autocast ops) and write into `out`.

Known differences from real FP16, all small against the effects we emulate: the backward of an
in-place op is not re-rounded; `tensor.dtype` still reports float32 (code branching on it takes
the FP32 branch); gradients of one FP16 tensor coming from several consumers are summed in FP32
before being rounded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .half_products import fp16_products

__all__ = [
    "fp16_emulation",
    "fp32_region",
    "measure_flushed_fraction",
    "accumulated_gradients",
    "compare_gradients",
    "POLICIES",
    "FP16Emulation",
]

# Autocast's lower-precision (FP16) list for CUDA (`torch.linalg.*` functions are seen by their
# `linalg_` names).
FP16_OPS = frozenset(
    {
        "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "mv", "bmm", "baddbmm", "addmm",
        "addmv", "addr", "addbmm", "einsum", "chain_matmul", "multi_dot", "linalg_multi_dot",
        "linalg_vecdot", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "conv_tbc", "convolution", "prelu", "scaled_dot_product_attention",
        "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    }
)  # fmt: skip
# CPU autocast leaves these out of its FP16 list (FP32 in, FP32 out): they follow their inputs
# (`lstm_cell`/`gru_cell`: their hidden state, see `_RNN_CELLS`). `tensordot` runs its products
# in FP16 there. Checked op by op against real CPU autocast by tests/test_autocast_tables.py.
_NOT_FP16_ON_CPU = frozenset({"mv", "addmv", "addr", "lstm_cell", "gru_cell", "convolution"})
FP16_OPS_BY_POLICY = {"cuda": FP16_OPS, "cpu": (FP16_OPS - _NOT_FP16_ON_CPU) | {"tensordot"}}
# On the CPU these cells compute their gates with autocast's FP16 products and combine them with
# the hidden state: the output is FP16 when the hidden state is.
_RNN_CELLS = frozenset({"lstm_cell", "gru_cell"})

# Losses and a few reductions: FP32 under CPU and CUDA autocast alike.
_FP32_COMMON = frozenset(
    {
        "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
        "kl_div", "binary_cross_entropy_with_logits", "poisson_nll_loss", "cosine_embedding_loss",
        "hinge_embedding_loss", "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss", "prod",
        "ctc_loss", "cdist", "pdist", "dist", "cosine_similarity",
    }
)  # fmt: skip

# CUDA autocast's FP32 list adds these (on the CPU they follow their inputs, FP16 in, FP16 out).
_FP32_CUDA_ONLY = frozenset(
    {
        "softmax", "log_softmax", "layer_norm", "group_norm", "sum", "cumsum", "cumprod", "exp",
        "expm1", "log", "log10", "log2", "log1p", "pow", "__pow__", "__rpow__", "rsqrt",
        "reciprocal", "acos", "asin", "cosh", "sinh", "tan", "erfinv", "softplus", "logsumexp",
        "norm", "frobenius_norm", "nuclear_norm", "renorm", "vector_norm", "matrix_norm",
        "linalg_vector_norm", "linalg_matrix_norm", "linalg_norm", "interpolate", "upsample",
        "__rdiv__", "__rtruediv__", "normalize", "softmin", "rms_norm",
    }
)  # fmt: skip

# CPU autocast's FP32 list beyond the common one (torch's "CPU Ops that can autocast to float32",
# under the names the emulation sees: torch.fft.* as fft_*, torch.linalg.* as linalg_*).
_FP32_CPU_ONLY = frozenset(
    {
        "avg_pool3d", "max_pool3d", "adaptive_avg_pool3d", "adaptive_max_pool3d", "max_unpool2d",
        "max_unpool3d", "fractional_max_pool2d", "fractional_max_pool3d", "binary_cross_entropy",
        "grid_sample", "polar", "quantile", "nanquantile", "stft", "trace", "view_as_complex",
        "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr", "pinverse",
        "geqrf", "qr", "svd", "triangular_solve", "fft_fft", "fft_ifft", "fft_fft2", "fft_ifft2",
        "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn",
        "fft_irfftn", "fft_hfft", "fft_ihfft", "linalg_cond", "linalg_matrix_rank", "linalg_solve",
        "linalg_cholesky", "linalg_svdvals", "linalg_eigvals", "linalg_eigvalsh", "linalg_inv",
        "linalg_householder_product", "linalg_tensorinv", "linalg_tensorsolve", "linalg_qr",
        "linalg_cholesky_ex", "linalg_svd", "linalg_eig", "linalg_eigh", "linalg_lstsq",
        "linalg_inv_ex",
    }
)  # fmt: skip
# CUDA's FP32 list only; on the CPU they follow their inputs.
_FP32_NOT_ON_CPU = frozenset({"cosine_similarity", "dist"})

POLICIES = {
    "cuda": _FP32_COMMON | _FP32_CUDA_ONLY,
    "cpu": (_FP32_COMMON - _FP32_NOT_ON_CPU) | _FP32_CPU_ONLY,
}
# F.pad's reflect and replicate modes are FP32 ops on the CPU (reflection_pad*, replication_pad*).
_FP32_PAD_MODES_ON_CPU = ("reflect", "replicate")

# Ops whose output values are exact given FP16 inputs (views, copies, selections): no rounding.
_EXACT_OPS = frozenset(
    {
        "view", "reshape", "transpose", "permute", "contiguous", "__getitem__", "expand",
        "expand_as", "unsqueeze", "squeeze", "flatten", "unflatten", "split", "chunk", "narrow",
        "select", "t", "cat", "concat", "stack", "relu", "neg", "__neg__", "abs", "clone",
        "detach", "repeat", "repeat_interleave", "flip", "roll", "gather", "index_select",
        "masked_select", "unbind", "view_as", "reshape_as", "tril", "triu", "max", "min", "amax",
        "amin", "pad", "movedim", "swapaxes", "squeeze_", "unsqueeze_", "max_pool1d", "max_pool2d",
    }
)  # fmt: skip

# Conversions: an explicit dtype decides (`.float()` / `.to(torch.float32)` of an FP16 tensor is
# FP32, as under autocast); a device move keeps FP16 FP16.
_CONVERSIONS = frozenset({"to", "float", "double", "half", "bfloat16", "type", "type_as", "cpu", "cuda"})
# Properties that are views of the tensor: FP16 stays FP16.
_VIEW_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real"})
_INPLACE_DUNDERS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__", "__ipow__"})

# Properties and queries: nothing to round or tag.
_PASSTHROUGH_PREFIXES = (
    "__get__",
    "__set__",
    "size",
    "dim",
    "numel",
    "is_",
    "data_ptr",
    "stride",
    "item",
    "tolist",
)

_TAG = "_hf_fp16"
#: The calls that run a backward: see `FP16Emulation._backward`.
_BACKWARDS = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)


def _is_fp16(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _TAG, False)


def _round(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunction():
        return t.to(torch.float16).to(t.dtype)


class _RoundToFP16(torch.autograd.Function):
    """Round values to FP16 in forward and the gradient to FP16 in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _round(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _round(grad)


def _to_fp16(t: torch.Tensor) -> torch.Tensor:
    """A rounded, tagged copy (with gradient rounding when it takes part in autograd)."""
    out = _RoundToFP16.apply(t) if t.requires_grad and torch.is_grad_enabled() else _round(t)
    setattr(out, _TAG, True)
    return out


def _float_tensors(args: Any) -> Iterator[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.dtype == torch.float32:
                yield a
        elif isinstance(a, (list, tuple)):
            yield from _float_tensors(a)


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value) if value.dtype == torch.float32 else value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_map_tensors(fn, v) for v in value)
    return value


def _cast_input(t: torch.Tensor) -> torch.Tensor:
    return t if _is_fp16(t) else _to_fp16(t)


def _tag(t: torch.Tensor) -> torch.Tensor:
    setattr(t, _TAG, True)
    return t


def _untagged(t: torch.Tensor) -> torch.Tensor:
    """The same values as a plain FP32 tensor: an alias (autograd-tracked) without the tag."""
    if not _is_fp16(t):
        return t
    with torch._C.DisableTorchFunction():
        return t.view_as(t)


def _reround_in_place(target: Any) -> None:
    """A virtually FP16 tensor written in place (or as `out=`) holds FP16 values again."""
    if _is_fp16(target):
        with torch._C.DisableTorchFunction():
            target.data.copy_(target.data.to(torch.float16).to(target.dtype))


def _is_inplace(name: str) -> bool:
    return (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_DUNDERS


def _convert(name: str, args: tuple, kwargs: dict, out: Any) -> Any:
    """Tag or untag a conversion's output as autocast would type it."""
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or source is None:
        return out
    others = [a for a in (*args[1:], kwargs.get("other")) if isinstance(a, torch.Tensor)]
    # a dtype, or for .type() a type name ("torch.FloatTensor"); for .to() a string is a device
    dtypes = [
        a for a in (*args[1:], kwargs.get("dtype"))
        if isinstance(a, torch.dtype) or (name == "type" and isinstance(a, str))
    ]  # fmt: skip
    if others:  # .to(other) / .type_as(other): the other's type, FP16 when it is virtually FP16
        fp16 = _is_fp16(others[0])
    elif dtypes or name == "float":  # an explicit FP32 request: real FP32
        fp16 = False
    else:  # a device move or a copy: the source's type
        fp16 = _is_fp16(source)
    if fp16:
        return out if out is source else _tag(out)
    return _untagged(out)


class FP16Emulation(TorchFunctionMode):
    """The mode behind `fp16_emulation()`; `policy` names the FP32 op list (`"cuda"` or `"cpu"`)."""

    def __init__(self, policy: str = "cuda") -> None:
        super().__init__()
        if policy not in POLICIES:
            raise ValueError(f"fp16_emulation policy={policy!r} is not one of {sorted(POLICIES)}.")
        self.policy = policy
        self._in_backward = False  # `_backward` is running a backward with the mode on
        self.fp32_ops = POLICIES[policy]
        self.fp16_ops = FP16_OPS_BY_POLICY[policy]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BACKWARDS:
            return self._backward(func, args, kwargs)
        if self._in_backward and isinstance(func, torch._ops.OpOverload):
            # an aten op called as such during a backward (`fp16_products()` dispatches the engine's ops
            # again from Python): the gradients' own arithmetic, which autocast does not type either
            return func(*args, **kwargs)
        if _FP32_REGION_DEPTH[0]:  # inside fp32_region(): real FP32, as outside autocast
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: .T, .mT, .H, .mH are views and stay FP16
            out = func(*args, **kwargs)
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            if prop in _VIEW_PROPERTIES and args and _is_fp16(args[0]) and isinstance(out, torch.Tensor):
                return _tag(out)
            return out
        if name.startswith(_PASSTHROUGH_PREFIXES):
            return func(*args, **kwargs)
        if name in _CONVERSIONS:
            return _convert(name, args, kwargs, func(*args, **kwargs))
        if kwargs.get("out") is not None:
            # `out=` variants are not autocast ops: they run in their tensors' real dtypes and write
            # into `out` (casting it would write into a copy and leave `out` unwritten). Like an
            # in-place op, a virtually FP16 `out` holds FP16 values afterwards.
            result = func(*args, **kwargs)
            for target in _float_tensors([kwargs["out"]]):
                _reround_in_place(target)
            return result
        if name in self.fp16_ops:
            args = _map_tensors(_cast_input, args)
            kwargs = {k: _map_tensors(_cast_input, v) for k, v in kwargs.items()}
            return _map_tensors(_to_fp16, func(*args, **kwargs))
        if self.policy == "cpu" and name in _RNN_CELLS:
            return self._rnn_cell_on_cpu(func, args, kwargs)
        out = func(*args, **kwargs)
        if _is_inplace(name):
            # In place, the result keeps the target's type: FP16 if it is virtually FP16, re-rounded
            # (values only: the backward of in-place ops is not rounded).
            _reround_in_place(args[0] if args else None)
            return out
        if name in self.fp32_ops or kwargs.get("dtype") is not None:
            return out
        if self.policy == "cpu" and name == "pad" and _pad_mode(args, kwargs) in _FP32_PAD_MODES_ON_CPU:
            return out
        inputs = list(_float_tensors(args)) + list(_float_tensors(kwargs.values()))
        if not any(_is_fp16(t) for t in inputs):
            return out
        # torch's promotion: dimensioned tensors decide over 0-d ones; among the deciding inputs,
        # any FP32 one makes the result FP32
        dimensioned = [t for t in inputs if t.dim() > 0]
        if any(not _is_fp16(t) for t in dimensioned or inputs):
            return out
        return _map_tensors(_tag if name in _EXACT_OPS else _to_fp16, out)

    def _backward(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """`loss.backward()` / `torch.autograd.backward()` / `torch.autograd.grad()` with this mode on.

        A mode is off while its own `__torch_function__` runs, and the autograd engine keeps the modes
        that were on when the backward started: called through torch's public functions from here,
        the backward would run without the emulation, and a forward that gradient checkpointing
        recomputes during it would be plain FP32 (its outputs unrounded; with `use_reentrant=True`
        its gradients too, whose underflow then goes unseen). So the engine is started with the mode
        put back on, as torch's functions start it once they are past their `__torch_function__`
        check (the same arguments, made ready by torch's own helper)."""
        from torch.autograd import _make_grads
        from torch.autograd.graph import _engine_run_backward

        grad = func is torch.autograd.grad
        if func is torch.Tensor.backward:  # torch calls it as (tensor, gradient=..., ...)
            outputs, given, inputs = args[0], kwargs.get("gradient"), kwargs.get("inputs")
        elif grad:  # (outputs, inputs, grad_outputs=..., ...)
            outputs, inputs, given = args[0], args[1], kwargs.get("grad_outputs")
        else:  # (tensors, grad_tensors=..., ...)
            outputs, given, inputs = args[0], kwargs.get("grad_tensors"), kwargs.get("inputs")
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        if (
            kwargs.get("is_grads_batched") or kwargs.get("materialize_grads")
            or kwargs.get("only_inputs", True) is not True
            or not all(isinstance(t, torch.Tensor) for t in outputs)
        ):  # fmt: skip
            # forms not taken apart here (batched or materialised gradients, gradient edges): torch's
            # own call, whose backward runs without the emulation
            return func(*args, **kwargs)
        if given is None or isinstance(given, torch.Tensor):
            given = (given,) * len(outputs) if given is None else (given,)
        grads = _make_grads(outputs, tuple(given), is_grads_batched=False)
        create = bool(kwargs.get("create_graph", False))
        retain = kwargs.get("retain_graph")
        if isinstance(inputs, dict):  # as torch's backward and grad take them
            inputs = tuple(inputs.values())
        elif inputs is not None:
            inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
            if not inputs:
                raise RuntimeError("`inputs` argument to `backward()` cannot be empty.")
        inputs = inputs or ()
        outer, self._in_backward = self._in_backward, True
        with self:
            try:
                result = _engine_run_backward(
                    outputs, grads, create if retain is None else retain, create, inputs,
                    allow_unreachable=bool(kwargs.get("allow_unused")) if grad else True, accumulate_grad=not grad,
                )  # fmt: skip
            finally:
                self._in_backward = outer
        return result if grad else None

    def _rnn_cell_on_cpu(self, func, args, kwargs):
        """`lstm_cell` / `gru_cell` under CPU autocast: FP16 products, so the output is FP16 exactly
        when the hidden state is (FP16 gates promote with an FP32 state to FP32)."""
        out = func(*args, **kwargs)
        state = args[1] if len(args) > 1 else kwargs.get("hx")
        state = list(state) if isinstance(state, (list, tuple)) else [state]
        if state and all(_is_fp16(t) for t in state if isinstance(t, torch.Tensor)):
            return _map_tensors(_to_fp16, out)
        return out


def _pad_mode(args: tuple, kwargs: dict) -> str:
    if "mode" in kwargs:
        return kwargs["mode"]
    return args[2] if len(args) > 2 and isinstance(args[2], str) else "constant"


_FP32_REGION_DEPTH = [0]


@contextlib.contextmanager
def fp32_region() -> Iterator[None]:
    """Inside it the emulation computes in plain FP32, as real autocast does under
    `torch.autocast(..., enabled=False)` (`hf_lossscale.fp16.fp32_modules` enters both). Upcast virtually
    FP16 inputs first (`fp32_modules.upcast`), as code leaving autocast calls `.float()`."""
    _FP32_REGION_DEPTH[0] += 1
    try:
        yield
    finally:
        _FP32_REGION_DEPTH[0] -= 1


@contextlib.contextmanager
def fp16_emulation(policy: str = "cuda") -> Iterator[FP16Emulation]:
    """Emulate FP16 autocast numerics in FP32 compute, forward and backward.

    Keep `backward()` inside the context too: with gradient checkpointing the forward is
    recomputed during backward. Never used implicitly on CUDA (use real autocast there). Tensors
    held in FP16 (a model loaded with `torch_dtype=torch.float16`) keep their FP16 arithmetic, and
    their matrix products run on FP32 kernels (`fp16_products()`): at FP32 speed on a CPU.

    Args:
        policy (`str`, *optional*, defaults to `"cuda"`): `"cuda"` follows CUDA autocast (softmax,
            layer_norm, sums, exp, pow, ... in FP32: what users run on GPUs); `"cpu"` follows
            `torch.autocast("cpu", dtype=torch.float16)`, where those ops follow their inputs.

    Example:

    ```python
    >>> import torch
    >>> from hf_lossscale import fp16_emulation
    >>> layer = torch.nn.Linear(4, 4)
    >>> with fp16_emulation():
    ...     y = layer(torch.full((1, 4), 1e-9))
    ...     (y.sum() * 1e-8).backward()
    >>> bool((layer.weight.grad == 0).all())  # 1e-8 gradients flush to zero in FP16
    True
    ```
    """
    mode = FP16Emulation(policy)
    # a model held in FP16: its products at FP32 speed, with a GPU's FP16 arithmetic
    with mode, fp16_products():
        yield mode


# ---------------------------------------------------------------------- flushed fraction
def _default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    out = model(**batch) if isinstance(batch, Mapping) else model(batch)
    return out.loss if hasattr(out, "loss") else out


def _context(fp16: str, policy: str) -> contextlib.AbstractContextManager:
    if fp16 == "emulate":
        return fp16_emulation(policy)
    if fp16 == "native":
        device = "cuda" if torch.cuda.is_available() and policy == "cuda" else "cpu"
        return torch.autocast(device, dtype=torch.float16)
    if fp16 == "fp32":
        return contextlib.nullcontext()
    raise ValueError(f"fp16={fp16!r} is not one of ('emulate', 'native', 'fp32').")


def accumulated_gradients(
    model, batch, loss_fn, context, multiplier, micro_batches=None
) -> dict[str, torch.Tensor]:
    """Parameter gradients of `loss * multiplier`, summed over `micro_batches` (each its own
    backward, as gradient accumulation does) or of the one `batch`."""
    model.zero_grad(set_to_none=True)
    with context:
        for part in micro_batches if micro_batches is not None else [batch]:
            loss = loss_fn(model, part)
            (loss.float() * multiplier).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare_gradients(
    reference: dict[str, torch.Tensor], low: dict[str, torch.Tensor], scale: float
) -> dict[str, Any]:
    """FP16 gradients `low` (at `scale`) against FP32 `reference`: flushed fraction overall and per
    owning module (with the counts behind it), relative error of `low / scale`, and overflow."""
    flushed: dict[str, list[int]] = {}
    err_sq = ref_sq = 0.0
    overflow = False
    for name, g32 in reference.items():
        g16 = low.get(name, torch.zeros_like(g32))
        module = name.rsplit(".", 1)[0] if "." in name else name
        nonzero = g32 != 0
        counts = flushed.setdefault(module, [0, 0])
        counts[0] += int(((g16 == 0) & nonzero).sum())
        counts[1] += int(nonzero.sum())
        finite = torch.isfinite(g16)
        overflow = overflow or not bool(finite.all())
        diff = torch.where(finite, g16.double() / scale, 0.0) - g32.double()
        err_sq += float(diff.pow(2).sum())
        ref_sq += float(g32.double().pow(2).sum())
    total_flushed = sum(c[0] for c in flushed.values())
    total_nonzero = sum(c[1] for c in flushed.values())
    return {
        "flushed_fraction": total_flushed / max(total_nonzero, 1),
        "per_module": {m: c[0] / max(c[1], 1) for m, c in flushed.items()},
        "counts": flushed,
        "relative_grad_error": (err_sq**0.5) / max(ref_sq**0.5, 1e-30),
        "overflow": overflow,
    }


def measure_flushed_fraction(
    model: torch.nn.Module,
    batch: Any,
    *,
    fp16: str = "emulate",
    policy: str = "cuda",
    scale: float = 1.0,
    loss_divisor: float = 1.0,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
    reference: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """For one batch, the fraction of non-zero FP32 gradient elements that come out zero in FP16.

    Runs an FP32 backward (unless `reference` gives its gradients) and an FP16 backward (emulated
    or native autocast) of `loss / loss_divisor * scale`, in eval mode (no dropout, so the two
    passes differ only by precision), and compares the parameter gradients.

    Args:
        model (`torch.nn.Module`): the model; its `.grad`s are cleared afterwards.
        batch: keyword inputs for the model (a dict) or one positional input.
        fp16 (`str`, *optional*, defaults to `"emulate"`): `"emulate"` or `"native"` (autocast).
        policy (`str`, *optional*, defaults to `"cuda"`): the emulation policy (see `fp16_emulation`).
        scale (`float`, *optional*, defaults to 1.0): the loss scale (1 = no loss scaling).
        loss_divisor (`float`, *optional*, defaults to 1.0): divides the loss, as gradient
            accumulation over that many micro-batches does.
        loss_fn (`callable`, *optional*): `loss_fn(model, batch) -> loss`; default `model(**batch).loss`.
        reference (`dict`, *optional*): FP32 gradients from an earlier call's `"reference"`, to reuse.

    Returns:
        `dict` with `flushed_fraction` (overall), `per_module` (by owning module name),
        `relative_grad_error` (||g16/scale - g32|| / ||g32||), `overflow` (any non-finite FP16
        gradient), `fp16` and `policy` (what produced the figures), and `reference`.
    """
    loss_fn = loss_fn or _default_loss
    was_training = model.training
    model.eval()
    try:
        if reference is None:
            reference = accumulated_gradients(
                model, batch, loss_fn, contextlib.nullcontext(), 1.0 / loss_divisor
            )
        low = accumulated_gradients(model, batch, loss_fn, _context(fp16, policy), scale / loss_divisor)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    found = compare_gradients(reference, low, scale)
    del found["counts"]
    return {**found, "fp16": fp16, "policy": policy, "scale": scale, "loss_divisor": loss_divisor,
            "reference": reference}  # fmt: skip
