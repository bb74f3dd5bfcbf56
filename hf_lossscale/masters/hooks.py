"""What the masters hang on their optimizer and on the FP16 parameters: torch's step pre/post hooks
(the chunked update runs between them), `state_dict` / `load_state_dict` hooks (each master in the
packed state), the wrapped `zero_grad` and mode switches, and the gradient hooks that keep the
gradient's one home through a backward on top of a marker.

Imports only torch.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .pair import COMPENSATION_KEY, RNG_KEY, STATE_KEY, GradientInMaster, Pair


def before_step(ref: weakref.ref, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    masters = ref()
    if masters is not None and masters.pairs:
        masters.set_aside(optimizer)


def after_step(ref: weakref.ref, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    masters = ref()
    if masters is not None and masters._work is not None:
        masters.update(optimizer)


def release(pairs: dict[int, Pair], handles: list) -> None:
    """The optimizer is gone: its hooks come off the FP16 parameters, and so do its markers (a later
    backward then collects a fresh FP16 gradient)."""
    for handle in handles:
        handle.remove()
    for pair in pairs.values():
        if pair.marker_is(pair.half.grad):
            pair.half.grad = None


def then_write_back(original: Callable, ref: weakref.ref, *args: Any, **kwargs: Any) -> Any:
    result = original(*args, **kwargs)
    masters = ref()
    if masters is not None:
        masters.take_loaded(final=True)
        masters.write_back()
    return result


def zero_grad(original: Callable, opt_ref: weakref.ref, ref: weakref.ref, set_to_none: bool = True) -> None:
    """`optimizer.zero_grad()`: the masters' gradients as torch clears them, and the FP16 side with them,
    so that the next backward collects a plain FP16 gradient again (visible to the user's code)."""
    optimizer = opt_ref()
    if isinstance(original, functools.partial):  # the class's method: needs the instance
        original(optimizer, set_to_none)
    else:  # the instance's own (already replaced by someone else): bound
        original(set_to_none)
    masters = ref()
    if masters is None:
        return
    for pair in masters.pairs.values():
        grad = pair.half.grad
        if grad is None:
            continue
        if not isinstance(grad, GradientInMaster):  # collected, not yet read: cleared as torch clears
            if set_to_none:
                pair.half.grad = None
            else:
                grad.zero_()
        elif pair.marker_is(grad) or not set_to_none:
            pair.on_top = False
            pair.drop()
            pair._marker = None
            # a zero gradient stays a zero gradient (FP16 zeros: read into the master at the next step)
            pair.half.grad = None if set_to_none else torch.zeros_like(pair.half)


def on_new_gradient(pair_ref: weakref.ref, grad_outputs: tuple) -> None:
    """A backward is about to accumulate into an FP16 parameter whose `.grad` is a marker: the marker
    goes (the new FP16 gradient is collected from zero) and `fold_on_top` adds it onto the master's."""
    pair = pair_ref()
    if pair is not None and pair.early and pair.live_pending() is None:
        # the stand-in left the master since the last backward (`p.grad = None` on the optimizer's
        # parameter): the FP16 gradient so far goes with it; a gradient set there by hand stays, and this
        # backward's adds onto it
        pair.early = False
        if not isinstance(pair.half.grad, GradientInMaster):
            pair.half.grad = None
        pair.on_top = pair.master.grad is not None
        return
    grad = pair.half.grad if pair is not None else None
    if not isinstance(grad, GradientInMaster):
        return
    owner = grad.__dict__.get("_hf_pair")
    owner = owner() if owner is not None else None
    if owner is pair:
        pair.on_top = True
        pair.half.grad = None
    elif owner is None or not owner.marker_is(grad):  # an orphan (its optimizer is gone): dropped
        pair.half.grad = None
    # else the marker of another live optimizer over this parameter: its own hook takes it


def fold_on_top(pair_ref: weakref.ref, half: torch.Tensor) -> None:
    """After a backward that came in on top of a marker: its FP16 gradient is added onto the master's
    at once, and the marker goes back, so that the gradient keeps one home (a `zero_grad()` from the
    model then reaches all of it)."""
    pair = pair_ref()
    if pair is None or half.grad is None or isinstance(half.grad, GradientInMaster):
        return
    if not pair.on_top:
        if pair.early and pair.live_pending() is not None:
            pair.pending = half.grad  # accumulating on the FP16 parameter (autograd may make a new tensor)
            return
        if pair.master.grad is None:  # the gradient sits on the FP16 parameter: a stand-in on the master
            pair.defer(half.grad)
            pair.early = True
            return
        pair.on_top = True  # the master holds a gradient set by hand: this one adds onto it
    pair.materialise()  # a pending gradient, cast: the new one adds onto it
    with torch.no_grad():
        if pair.master.grad is None:
            pair.master.grad = half.grad.float()
        else:
            pair.master.grad.add_(half.grad)
    pair.on_top = False
    pair.leave_marker()


def state_dict_hook(ref: weakref.ref, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Each master in the packed state, under STATE_KEY (a new dict per entry: the live state is untouched)."""
    masters = ref()
    if masters is None:
        return state_dict
    packed = state_dict["state"]
    devices = set()
    for index, param in _first_places(optimizer.param_groups):
        pair = masters.by_master.get(id(param))
        if pair is not None and pair.master is param:
            if pair.compensation is not None:
                extra = {COMPENSATION_KEY: pair.compensation.detach().clone()}
            elif pair.shell:
                extra = {}
            else:
                extra = {STATE_KEY: param.detach()}
            gen = masters.generators.get(pair.half.device)
            if gen is not None and pair.half.device not in devices:  # each device's generator, once
                devices.add(pair.half.device)
                extra[RNG_KEY] = gen.get_state()
            if extra:
                packed[index] = {**packed.get(index, {}), **extra}
    return state_dict


def load_pre_hook(ref: weakref.ref, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Take the masters out of a state being loaded (the optimizer never sees them): each is checked
    against its FP16 weight at the next step. Entries for parameters without a master are dropped."""
    masters = ref()
    if masters is None:
        return state_dict
    saved = itertools.chain.from_iterable(g["params"] for g in state_dict.get("param_groups", []))
    current = itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)
    id_map = dict(zip(saved, current, strict=False))  # as torch maps them
    state = {}
    for key, entry in state_dict["state"].items():
        if isinstance(entry, dict) and RNG_KEY in entry:
            entry = dict(entry)
            rng = entry.pop(RNG_KEY)
            param = id_map.get(key)
            pair = masters.by_master.get(id(param)) if param is not None else None
            if pair is not None and pair.half.device in masters.generators and isinstance(rng, torch.Tensor):
                masters._loaded_rng[pair.half.device] = rng.detach().to("cpu", torch.uint8)
                masters._loaded = True
        if isinstance(entry, dict) and (STATE_KEY in entry or COMPENSATION_KEY in entry):
            entry = dict(entry)
            value = entry.pop(STATE_KEY, None)
            comp = entry.pop(COMPENSATION_KEY, None)
            param = id_map.get(key)
            pair = masters.by_master.get(id(param)) if param is not None else None
            other_mode = pair is not None and (comp is None) != (pair.compensation is None)
            no_master = pair is not None and pair.shell and comp is None  # (stochastic rounding keeps none)
            if other_mode or no_master:
                value = None  # a state of another mode: the weights alone stand (a stale entry)
            else:
                value = comp if comp is not None else value
            if pair is not None and pair.master is param and isinstance(value, torch.Tensor):
                if value.shape != param.shape:
                    raise ValueError(
                        f"master_weights: the loaded master for {pair.name or 'a parameter'} has shape "
                        f"{tuple(value.shape)}, its parameter {tuple(param.shape)}: not this model's state."
                    )
                dtype = torch.float16 if pair.compensation is not None else torch.float32
                pair.loaded = value.detach().to(device=param.device, dtype=dtype)
                masters._loaded = True
        state[key] = entry
    return {**state_dict, "state": state}


def _first_places(groups: list[dict]) -> list[tuple[int, torch.Tensor]]:
    """(index, parameter) as torch's `state_dict` numbers them: a parameter listed twice keeps its first."""
    seen: set[int] = set()
    out = []
    index = 0
    for group in groups:
        for param in group["params"]:
            if id(param) not in seen:
                seen.add(id(param))
                out.append((index, param))
                index += 1
    return out


def load_post_hook(ref: weakref.ref, optimizer: torch.optim.Optimizer) -> None:
    masters = ref()
    if masters is not None:
        masters.take_loaded(final=False)
