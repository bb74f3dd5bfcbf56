"""Where an FP16 overflow starts: `find_overflow_origin` replays a batch with module hooks.

Two kinds, told apart because they need different fixes:

- **forward**: the first module, in execution order, whose output is non-finite while its inputs are
  finite. The loss is then non-finite and no loss scale can help: run that module in FP32
  (`LossScaleConfig.fp32_modules`).
- **backward**: the first module, in backward order, whose input gradient (or one of its own
  parameters' gradients) is non-finite while its output gradient is finite. The scale is too high
  for that module: the dynamic rule backs off, which is the fix.

Nothing runs on clean steps: the diagnosis replays a batch that overflowed, with hooks on every
module (one forward, and for a finite loss one backward that writes no `.grad`), reading a flag per
module on the host until the origin is settled. Dropout draws from a forked RNG, so training's random stream is untouched;
buffers (running statistics) are restored afterwards. Imports only torch.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .module_hooks import ModuleHooks
from .telemetry import FP16_MAX

__all__ = ["find_overflow_origin", "display_origin", "floating_tensors", "rng_state"]


def display_origin(origin: str | None) -> str:
    """A module name for a message: `""` (the model itself: a loss or head computed in its own forward,
    outside its submodules) and None (not found) spelled out."""
    if origin is None:
        return "(no module found)"
    return f"`{origin}`" if origin else "the model's own forward (outside its submodules)"


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict) or hasattr(value, "values"):  # dicts, ModelOutput
        try:
            items = list(value.values())
        except Exception:  # noqa: BLE001 - an object with an unrelated values()
            return
        for v in items:
            yield from _tensors(v)


def floating_tensors(value: Any) -> list[torch.Tensor]:
    """The floating tensors in a value: a tensor, nested tuples and lists, dicts and model outputs."""
    return [t for t in _tensors(value) if t.is_floating_point()]


def _is_fp16(t: torch.Tensor) -> bool:
    return t.dtype == torch.float16 or getattr(t, "_hf_fp16", False)


def _finite(tensors: list[torch.Tensor]) -> bool:
    with torch._C.DisableTorchFunction(), torch.no_grad():
        return all(bool(torch.isfinite(t).all()) for t in tensors if t.numel())


def _fits_fp16(tensors: list[torch.Tensor]) -> bool:
    """Finite, and within FP16's range (a gradient of an FP16 tensor is FP16: beyond 65504 it is inf
    in real FP16; the emulation rounds it one node later, so the range check keeps the two alike)."""
    with torch._C.DisableTorchFunction(), torch.no_grad():
        return all(bool((t.abs() <= FP16_MAX).all()) for t in tensors if t.numel())


@contextlib.contextmanager
def _preserved(model: torch.nn.Module) -> Iterator[None]:
    """Fork the RNG (CPU and the model's CUDA devices) and restore the buffers afterwards."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for n, b in model.named_buffers():
                    if n in buffers:
                        b.copy_(buffers[n])


def rng_state(model: torch.nn.Module) -> dict[str, Any]:
    """The random-number state a forward of `model` draws from (CPU, and its CUDA devices): taken
    before a training forward, it lets a replay draw the same dropout masks. Host copies of the
    generators' state; no device work."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if devices:
        state["cuda"] = {d: torch.cuda.get_rng_state(d) for d in devices}
    return state


def _set_rng_state(state: dict[str, Any] | None) -> None:
    if state is None:
        return
    torch.set_rng_state(state["cpu"])
    for device, value in state.get("cuda", {}).items():
        torch.cuda.set_rng_state(value, device)


def find_overflow_origin(
    model: torch.nn.Module,
    batches: list[Any],
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    *,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    scale: float = 1.0,
    rng_states: list[dict[str, Any] | None] | None = None,
) -> dict[str, Any] | None:
    """Replay `batches` (one optimizer step's micro-batches) through `model` under `context` (the FP16
    compute: autocast or `fp16_emulation`) until one overflows; say where it starts.

    Returns None when no batch overflows in the replay (a transient overflow, or one that depends on
    the dropout mask), else a dict: `kind` (`"forward"` or `"backward"`), `origin` (the module name;
    `""` for the model itself, e.g. a loss computed in its forward), `module_type`, `batch` (its index),
    `loss_finite`, and for a backward overflow `scale` (the scale replayed) and `params` (the
    origin's own parameters with non-finite gradients).

    `loss_fn(model, batch)` returns the loss as training computes it (e.g. the Trainer's
    `compute_loss`); the backward replays `loss * scale` without writing `.grad`. `rng_states` (one per
    batch, from `rng_state(model)` before its training forward) make the replay draw the training
    step's dropout masks; without them it draws others, and an overflow that depends on the mask may
    not reproduce. Either way training's own random stream is left as it was.
    """
    names = {m: (n or "") for n, m in model.named_modules()}
    batches = list(batches)  # a snapshot: the replay must not see batches it adds
    states = list(rng_states) if rng_states is not None else [None] * len(batches)
    for index, (batch, state) in enumerate(zip(batches, states, strict=True)):
        with _preserved(model):
            found = _replay(model, names, batch, loss_fn, context, scale, state)
        if found is not None:
            return {**found, "batch": index}
    return None


def _replay(model, names, batch, loss_fn, context, scale, state=None):
    """One forward with forward and backward hooks on every module; the backward only when the
    forward found no origin and the loss is finite."""
    forward: list[str] = []
    out_fp16: dict[str, bool] = {}
    order: list[tuple[str, bool, bool]] = []  # (module, output grad fits FP16, input grad finite)
    settled = [False]  # a module with fine output and bad input gradients fired: the rest need no check

    def after_forward(name, module, args, kwargs, output):
        outs = floating_tensors(output)
        out_fp16[name] = any(_is_fp16(t) for t in outs)
        if not forward and not _finite(outs) and _finite(floating_tensors(args) + floating_tensors(kwargs)):
            forward.append(name)

    def after_backward(name, module, grad_input, grad_output):
        if settled[0]:
            return
        outs = [g for g in grad_output if g is not None]
        # within 65504 is finite too: one pass where the output is FP16
        out_ok = _fits_fp16(outs) if out_fp16.get(name) else _finite(outs)
        in_ok = _finite([g for g in grad_input if g is not None])
        order.append((name, out_ok, in_ok))
        settled[0] = out_ok and not in_ok

    params = [p for p in model.parameters() if p.requires_grad]
    with warnings.catch_warnings():
        # modules none of whose inputs require grad (embeddings, the model itself) fire at their
        # output's gradient; torch warns about it once per module
        warnings.simplefilter("ignore", UserWarning)

        def run(backward_hooks: bool) -> tuple[bool, Any]:
            forward.clear()
            order.clear()
            settled[0] = False
            backward = after_backward if backward_hooks else None
            with ModuleHooks(model, forward=after_forward, with_kwargs=True, backward=backward):
                _set_rng_state(state)
                with context():
                    loss = loss_fn(model, batch)
                    finite = _finite(floating_tensors(loss))
                    if forward or not finite:
                        return finite, None
                    return finite, torch.autograd.grad(loss.float() * scale, params, allow_unused=True)

        try:
            loss_finite, grads = run(backward_hooks=True)
        except RuntimeError:  # a model that modifies module outputs in place refuses full hooks
            loss_finite, grads = run(backward_hooks=False)
    if forward:
        return _result("forward", forward[0], names, loss_finite=loss_finite)
    if not loss_finite:  # non-finite without a module to blame: the loss arithmetic outside the model
        return {"kind": "forward", "origin": None, "module_type": None, "loss_finite": False}
    bad_params = {id(p) for p, g in zip(params, grads, strict=True) if g is not None and not _finite([g])}
    if not bad_params:
        return None
    own_bad = {
        names[m]: [
            f"{names[m]}.{n}".lstrip(".") for n, p in m.named_parameters(recurse=False) if id(p) in bad_params
        ]
        for m in names
    }
    for name, out_ok, in_ok in order:
        if out_ok and (not in_ok or own_bad.get(name)):
            return {**_result("backward", name, names, loss_finite=True), "scale": scale,
                    "params": own_bad.get(name, [])}  # fmt: skip
    # no hook order (refused hooks) or nothing qualified: the last module in forward order whose own
    # parameters hold non-finite gradients is where backward met them first
    culprits = [n for n in names.values() if own_bad.get(n)]
    if culprits:
        return {**_result("backward", culprits[-1], names, loss_finite=True), "scale": scale,
                "params": own_bad[culprits[-1]]}  # fmt: skip
    return None


def _result(kind: str, origin: str, names: dict, *, loss_finite: bool) -> dict[str, Any]:
    module = next(m for m, n in names.items() if n == origin)
    return {"kind": kind, "origin": origin, "module_type": type(module).__name__, "loss_finite": loss_finite}
