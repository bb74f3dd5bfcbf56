"""Modules that run in FP32 inside an FP16 run: the remedy for an overflow no loss scale can fix.

`run_in_fp32(model, patterns)` wraps the forward of each module whose name matches a pattern: it runs
outside autocast (CUDA or CPU) and outside `fp16_emulation`, with its floating inputs upcast to FP32,
and returns FP32 outputs (the next FP16 op casts them down again, as autocast does at any FP32 op).
The model's own `_keep_in_fp32_modules` (transformers keeps those weights in FP32 when loading in half
precision; under autocast they would still compute in FP16) join the patterns.

A pattern matches a module's dotted name when it is the name, a dotted suffix of it
(`"attention.self"` matches `bert.encoder.layer.0.attention.self`), a run of its components
(`"query"` matches every `...attention.self.query`), or an `fnmatch` pattern of it (`"*.layer.3.*"`).
A module inside one that already runs in FP32 is not wrapped again. Imports only torch.
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .emulation import fp32_region

__all__ = [
    "matches",
    "modules_matching",
    "run_in_fp32",
    "runs_in_fp32",
    "unwrap",
    "fp32_module_names",
    "ancestors",
    "upcast",
]

_FLAG = "_hf_lossscale_fp32"


def matches(name: str, pattern: str) -> bool:
    """Whether module name `name` matches `pattern` (see the module docstring)."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return f".{pattern}." in f".{name}."


def modules_matching(model: torch.nn.Module, patterns: Iterable[str]) -> dict[str, list[str]]:
    """pattern -> the names of the modules it matches (outermost matches only), in model order."""
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, list[str]] = {}
    for pattern in patterns:
        hits = [n for n in names if matches(n, pattern)]
        out[pattern] = [n for n in hits if not any(n.startswith(h + ".") for h in hits)]
    return out


def upcast(value: Any) -> Any:
    """Floating tensors (FP16, BF16, or virtually FP16 under the emulation) as new FP32 tensors, in
    nested tuples, lists and dicts; everything else as it is."""
    if isinstance(value, torch.Tensor):
        if value.dtype in (torch.float16, torch.bfloat16):
            return value.float()
        if value.dtype == torch.float32 and getattr(value, "_hf_fp16", False):
            with torch._C.DisableTorchFunction():
                return value.clone()  # a real FP32 copy, as .float() of an FP16 tensor is
        return value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(upcast(v) for v in value)
    if isinstance(value, dict):
        return {k: upcast(v) for k, v in value.items()}
    return value


def _device_type(module: torch.nn.Module, args: Any, kwargs: dict) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    for tensor in module.parameters():
        return tensor.device.type
    return "cpu"


@contextlib.contextmanager
def _no_autocast(device_type: str) -> Iterator[None]:
    with (
        torch.autocast(device_type, enabled=False)
        if device_type in ("cuda", "cpu")
        else contextlib.nullcontext()
    ):
        with fp32_region():
            yield


class _FP32Forward:
    """The forward `run_in_fp32` installs: the module's own forward outside autocast, its floating
    inputs upcast. It holds the module as an attribute, not in a closure, so `copy.deepcopy(model)`
    (EMA, `AveragedModel`, a reference model) gives the copy a forward that runs the copy's weights,
    and the model pickles."""

    def __init__(self, module: torch.nn.Module, inner: Any = None) -> None:
        self.module = module
        self.inner = inner  # a forward set on the instance before ours (None: the class's)
        self._with_copies = False  # inside functional_call with FP32 copies of half weights

    def _target(self) -> Any:
        return self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)

    @property
    def __signature__(self) -> inspect.Signature:  # what the Trainer and accelerate inspect
        return inspect.signature(self._target())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if self._with_copies:  # the FP32 copies are in place (below): run the module's own forward
            return self._target()(*args, **kwargs)
        with _no_autocast(_device_type(module, args, kwargs)):
            args, kwargs = upcast(args), upcast(kwargs)
            # Half-precision weights (a frozen FP16 base, a model loaded in FP16) compute as FP32 copies,
            # made per call: a matmul of FP32 inputs with FP16 weights would fail. Gradients reach the
            # half weights through the casts; frozen ones get none.
            half = {
                name: tensor.float()
                for name, tensor in (*module.named_parameters(), *module.named_buffers())
                if tensor.dtype in (torch.float16, torch.bfloat16)
            }
            if not half:
                return self._target()(*args, **kwargs)
            self._with_copies = True
            try:
                return torch.func.functional_call(module, half, args, kwargs, strict=False)
            finally:
                self._with_copies = False


def _wrap(module: torch.nn.Module) -> None:
    module.forward = _FP32Forward(module, module.__dict__.get("forward"))
    setattr(module, _FLAG, True)


def run_in_fp32(
    model: torch.nn.Module, patterns: Iterable[str], *, strict: bool = True, include_model_own: bool = True
) -> list[str]:
    """Run the modules matching `patterns` (and, with `include_model_own`, the model's own
    `_keep_in_fp32_modules`) in FP32. Idempotent. Returns the names of the modules newly wrapped.

    Raises:
        ValueError: with `strict`, a pattern of `patterns` that matches no module, named with a few
            of the model's module names (the model's own list may match nothing: it is per architecture).
    """
    patterns = list(patterns)
    hits = modules_matching(model, patterns)
    unmatched = [p for p, names in hits.items() if not names]
    if strict and unmatched:
        sample = [n for n, _ in model.named_modules() if n][:6]
        raise ValueError(
            f"fp32_modules: {unmatched} match no module of {type(model).__name__} (names are dotted paths "
            f"such as {sample}; a pattern may be a name, a dotted suffix, or an fnmatch pattern)."
        )
    own = [p for p in (getattr(model, "_keep_in_fp32_modules", None) or []) if p not in patterns]
    if include_model_own and own:
        hits.update(modules_matching(model, own))
    named = dict(model.named_modules())
    wrapped = []
    for name in sorted({n for names in hits.values() for n in names}):
        if any(getattr(named[p], _FLAG, False) for p in ancestors(name)):
            continue  # already inside an FP32 module
        if not getattr(named[name], _FLAG, False):
            _wrap(named[name])
            wrapped.append(name)
    return wrapped


def ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def fp32_module_names(model: torch.nn.Module) -> list[str]:
    """The modules of `model` that run in FP32 (through `run_in_fp32`), in model order."""
    return [n for n, m in model.named_modules() if getattr(m, _FLAG, False)]


def runs_in_fp32(module: torch.nn.Module) -> bool:
    """Whether `run_in_fp32` wrapped this module."""
    return bool(getattr(module, _FLAG, False))


def unwrap(module: torch.nn.Module) -> None:
    """Undo `run_in_fp32` on one module (its own forward back in force)."""
    if runs_in_fp32(module):
        inner = module.__dict__["forward"].inner
        del module.forward
        if inner is not None:
            module.forward = inner
        delattr(module, _FLAG)
