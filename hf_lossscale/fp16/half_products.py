"""A model held in FP16 on a CPU at FP32 speed: its matrix products run on FP32 kernels.

A CPU without AVX512-FP16 computes an FP16 matrix product through a slow reference path: a
MiniLM-L6 step with its weights in FP16 takes about 15x the FP32 step. `fp16_products()` is a
dispatch mode that runs the products of FP16 tensors (`mm`, `addmm`, `bmm`, `baddbmm`, convolution,
CPU scaled-dot-product attention, forward and backward) on FP32 copies of their inputs and rounds
each output to FP16 once: the arithmetic of a GPU's FP16 product (FP32 accumulation, one rounding
of the result), within the summation order of the native CPU kernel (1 FP16 ulp). Every other op
runs natively in FP16, and every tensor the model holds, its gradients included, stays FP16. The
in-place and `out=` variants of the products (`addmm_`, `torch.mm(..., out=buf)`) are not taken:
they run natively.

`fp16_emulation()` enters it, so `fp16_on_cpu="emulate"` (the default) covers models held in FP16
too; a product that mixes FP16 with another floating dtype is left to torch (which refuses it as
it would without the mode).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["fp16_products", "FP16Products"]

_aten = torch.ops.aten


def _products() -> dict[Any, frozenset[int]]:
    """op -> the indices of its outputs that stay FP32 (as the native op returns them)."""
    ops: dict[Any, frozenset[int]] = {}
    # `linear` reaches the dispatcher whole under `torch.inference_mode()` (decomposed otherwise)
    for name in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "linear",
                 "_addmm_activation", "convolution", "convolution_backward",
                 "_scaled_dot_product_flash_attention_for_cpu_backward"):  # fmt: skip
        packet = getattr(_aten, name, None)
        if packet is not None:
            ops[packet.default] = frozenset()
    flash = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is not None:  # (output, logsumexp): the logsumexp is FP32 for FP16 inputs
        ops[flash.default] = frozenset({1})
    return ops


PRODUCTS = _products()
#: Ops that take an FP32 tensor beside FP16 ones natively: the attention backward's logsumexp.
_FP32_INPUTS_ALLOWED = frozenset(
    packet.default
    for packet in [getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)]
    if packet is not None
)


def _up(t: Any) -> Any:
    return t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.float16 else t


class FP16Products(TorchDispatchMode):
    """The mode behind `fp16_products()`. `calls` counts the products it ran in FP32."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        keep_fp32 = PRODUCTS.get(func)
        if keep_fp32 is None or not _all_half(args, kwargs, func in _FP32_INPUTS_ALLOWED):
            return func(*args, **kwargs)
        self.calls += 1
        out = func(*tree_map(_up, args), **tree_map(_up, kwargs))
        if isinstance(out, torch.Tensor):
            return _down(out)
        return type(out)(v if i in keep_fp32 else _down(v) for i, v in enumerate(out))


def _all_half(args: tuple, kwargs: dict, fp32_allowed: bool = False) -> bool:
    """Whether the floating tensors among the inputs are all FP16 (and there is one); with
    `fp32_allowed`, FP16 and FP32 ones (the FP32 ones stay as they are)."""
    floats = [
        t.dtype
        for t in tree_flatten((args, kwargs))[0]
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    allowed = (torch.float16, torch.float32) if fp32_allowed else (torch.float16,)
    return torch.float16 in floats and all(d in allowed for d in floats)


def _down(t: Any) -> Any:
    return t.to(torch.float16) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t


@contextlib.contextmanager
def fp16_products() -> Iterator[FP16Products]:
    """Run the matrix products of FP16 tensors on FP32 kernels, rounding each result to FP16 once.

    Example:

    >>> model = model.half()
    >>> with fp16_products():
    ...     loss = model(**batch).loss.float()
    ...     loss.backward()  # the FP16 gradients, at FP32 speed on a CPU
    """
    with FP16Products() as mode:
        yield mode
