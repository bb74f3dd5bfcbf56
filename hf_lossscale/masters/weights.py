"""FP32 master weights for trainable FP16 parameters: the classic design of loss scaling.

`MasterWeights` is the scaler's view of them; each optimizer holds its own (`OptimizerMasters`).

A model held in FP16 (loaded in its checkpoint's dtype, or cast with `.half()` for memory) runs its
forward and backward in FP16; the optimizer steps on FP32 copies of its trainable FP16 parameters
(the masters), and the FP16 weights are written from them after each step. Everything a user does
with FP32 weights then gives the same run, or an error that says why not.

Who owns what:

- **The optimizer owns its masters.** They sit in its parameter groups in place of the FP16
  parameters (so its state, its `zero_grad()`, its fused kernels and its `state_dict()` are the
  FP32 ones), and the bookkeeping (`OptimizerMasters`) is an attribute of the optimizer itself: it
  lives exactly as long as the optimizer, whichever scaler looks at it. The FP16 parameters are held
  by the tensors themselves (never by an `id()` that a later object can reuse).
- **A master is made the first time its FP16 parameter is seen trainable in the groups**: at
  `attach`, at a step, after `add_param_group` or after unfreezing. One per tensor: tied weights, or
  a parameter listed twice, get one.
- **The gradient has one home.** The FP16 `.grad` collects a backward's gradient (in FP16, as the
  model computes it); the first gradient read of an iteration (`unscale_`, a clip, `step`) moves it
  into the master's FP32 `.grad` (one read, the FP16 one freed) and leaves a `GradientInMaster`
  marker on the FP16 parameter whose values are the master's gradient (torch's
  `clip_grad_norm_(model.parameters())` reads and clips it); `zero_grad()` from either side clears it,
  as it would clear an FP32 parameter's; a backward on top of it accumulates onto the master's.
- **Weights follow from either side.** After a step the FP16 weights are the masters rounded to
  nearest (ties to even). When something else writes the FP16 weights (`model.load_state_dict`, an
  FP32 phase, a hand edit: seen by the tensor's version counter), the masters are read again from
  them at the next step. A cast of the model (`model.float()`, `.to(torch.bfloat16)`) is not a
  write: the masters carry on and the weights are them in the new dtype.
- **A state carries its masters.** `optimizer.state_dict()` holds each master under
  `state[i]["hf_lossscale_master"]` (every optimizer, SGD without momentum and parameters that never
  got a gradient included); `load_state_dict()` takes them and, at the next step, keeps a loaded master
  only if, rounded, it equals its FP16 weight; otherwise (a stale entry, a corrupted file) it is
  rebuilt from the weight with a warning that names the parameter. An optimizer state loaded before
  the masters existed was cast to FP16 by torch: refused, with the remedy.

Imports only torch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .optimizer import OptimizerMasters
from .optimizer_wrappers import inner_optimizer
from .pair import HALF_DTYPES, MODES, STATE_KEY, GradientInMaster, PendingGradient, extra_bytes

__all__ = [
    "MasterWeights", "OptimizerMasters", "GradientInMaster", "HALF_DTYPES", "STATE_KEY", "masters_of", "half_of",
    "gradient_of", "grad_for", "mode_of",
]  # fmt: skip

_ATTR = "_hf_lossscale_masters"  # the optimizer's own attribute holding its OptimizerMasters
_CHECKED = (
    "_hf_lossscale_fp16_checked"  # for an optimizer without masters: (its layout, its frozen FP16 params)
)


def mode_of(setting: Any) -> str:
    """The way of holding the weights that `config.master_weights` names (True and "auto": "masters")."""
    return setting if setting in MODES[1:] else "masters"


def masters_of(optimizer: Any, create: bool = False, mode: str = "masters") -> OptimizerMasters | None:
    """The optimizer's masters (the torch optimizer inside Accelerate's wrapper), made when `create`."""
    inner = inner_optimizer(optimizer)
    found = inner.__dict__.get(_ATTR)
    if found is None and create:
        found = OptimizerMasters(inner, mode)
        inner.__dict__[_ATTR] = found
    elif found is not None and create and found.mode != mode:
        raise ValueError(
            f"master_weights: this optimizer holds its FP16 parameters' weights as {found.mode!r}, and this "
            f"scaler is configured for {mode!r}: one optimizer keeps one way (make a new optimizer to change it)."
        )
    return found


class MasterWeights:
    """The scaler's view of the masters of the optimizers it steps (each optimizer holds its own)."""

    def __init__(
        self, names: Callable[[torch.Tensor], str | None] | None = None, mode: Any = "masters"
    ) -> None:
        self._names = names or (lambda p: None)
        #: how the FP16 parameters' weights are held for the optimizer: "masters", "kahan" or
        #: "stochastic_rounding" (`config.master_weights`, see `masters.step`)
        self.mode = mode_of(mode)
        self._seen: weakref.WeakSet = weakref.WeakSet()  # optimizers with masters, for `bytes()`

    @staticmethod
    def half_trainable(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
        """The optimizer's trainable parameters held in FP16 (not yet stepping on masters)."""
        return [
            p
            for g in inner_optimizer(optimizer).param_groups
            for p in g["params"]
            if p.dtype in HALF_DTYPES and p.requires_grad
        ]

    def attach(self, optimizer: torch.optim.Optimizer) -> int:
        """Masters for the optimizer's trainable FP16 parameters now (before `load_state_dict` of a
        resumed state); returns how many were made. Idempotent; a step does it by itself."""
        inner = inner_optimizer(optimizer)
        if not self.half_trainable(inner) and masters_of(inner) is None:
            return 0
        self._seen.add(inner)
        return masters_of(inner, create=True, mode=self.mode).sync_params(inner, self._names)

    def attached(self, optimizer: torch.optim.Optimizer) -> bool:
        found = masters_of(optimizer)
        return found is not None and bool(found.pairs)

    def prepare(self, optimizer: torch.optim.Optimizer, defer: bool = False) -> None:
        """Masters for any new trainable FP16 parameter, then this iteration's FP16 gradients read into them
        (`defer`: taken as they are where the step casts them chunk by chunk; see `OptimizerMasters.gather`)."""
        inner = inner_optimizer(optimizer)
        found = masters_of(inner)
        if found is None:
            if not self._may_need_masters(inner):
                return
            found = masters_of(inner, create=True, mode=self.mode)
            self._seen.add(inner)
        found.sync_params(inner, self._names)
        found.order_hooks(inner)
        found.gather(inner, defer)

    def pending(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The optimizer's FP16 gradients read but not yet cast (`prepare(defer=True)`)."""
        found = masters_of(optimizer)
        return found.pending() if found is not None else []

    def set_factor(self, optimizer: torch.optim.Optimizer, factor: torch.Tensor) -> None:
        """The multiplier the pending gradients take when the step casts them (unscale, clip)."""
        found = masters_of(optimizer)
        if found is not None:
            found.set_factor(factor)

    def materialise(self, optimizer: torch.optim.Optimizer) -> None:
        """Pending gradients cast into the masters' `.grad` (for a reader of them all)."""
        found = masters_of(optimizer)
        if found is not None:
            found.materialise()

    @staticmethod
    def _may_need_masters(optimizer: torch.optim.Optimizer) -> bool:
        """Whether the optimizer holds a trainable FP16 parameter; looked up once per layout of its groups
        (and then only its frozen FP16 parameters), not at every step of an FP32 model."""
        # the groups' lengths and first dtypes: `add_param_group`, or a `model.half()` after an FP32 phase
        layout = tuple(
            (len(g["params"]), g["params"][0].dtype if g["params"] else None) for g in optimizer.param_groups
        )
        seen = optimizer.__dict__.get(_CHECKED)
        if seen is not None and seen[0] == layout:
            return any(p.requires_grad for p in seen[1])
        halves = [p for g in optimizer.param_groups for p in g["params"] if p.dtype in HALF_DTYPES]
        optimizer.__dict__[_CHECKED] = (layout, [p for p in halves if not p.requires_grad])
        return any(p.requires_grad for p in halves)

    def pairs(self, optimizer: torch.optim.Optimizer) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        found = masters_of(optimizer)
        return [(p.half, p.master) for p in found.pairs.values()] if found is not None else []

    def follow_weights(self, optimizer: torch.optim.Optimizer) -> None:
        """Masters read again from FP16 weights written from outside since the gradients were read."""
        found = masters_of(optimizer)
        if found is not None:
            found.follow_weights()

    def write_back(self, optimizer: torch.optim.Optimizer) -> None:
        found = masters_of(optimizer)
        if found is not None:
            found.write_back()

    def master_of(self, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor:
        """The master of an FP16 parameter of this optimizer (the parameter itself otherwise)."""
        found = masters_of(optimizer)
        return param if found is None else found.master_of(param)

    def grad(self, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor | None:
        """A parameter's gradient as the optimizer will step on it (FP32, still scaled before `unscale_`),
        for an FP16 parameter with a master or the master itself, without moving anything; for any
        other parameter its `.grad`."""
        found = masters_of(optimizer)
        pair = None
        if found is not None:
            pair = found.pairs.get(id(param)) or found.by_master.get(id(param))
        if pair is None or (pair.half is not param and pair.master is not param):
            return param.grad
        collected = pair.half.grad
        if collected is None or isinstance(collected, GradientInMaster):
            return (
                pair.fp32_grad()
                if pair.marker_is(collected) or collected is None and pair.master.grad is None
                else None
            )
        if pair.early and pair.live_pending() is None:  # cleared (or replaced) on the master since
            return pair.master.grad
        base = pair.fp32_grad() if pair.on_top else None
        return collected.float() if base is None else base + collected.float()

    def bytes(self, optimizer: torch.optim.Optimizer | None = None) -> int:
        """What holding the weights costs beyond the FP16 weights themselves: 4 bytes per trainable FP16
        parameter for masters, 2 for "kahan" (its compensation buffer), 0 for "stochastic_rounding"; of
        one optimizer, or of all the live optimizers this scaler made masters for."""
        optimizers = [inner_optimizer(optimizer)] if optimizer is not None else list(self._seen)
        return sum(
            extra_bytes(p)
            for opt in optimizers
            if (found := masters_of(opt)) is not None
            for p in found.pairs.values()
        )

    def __getstate__(self) -> dict[str, Any]:  # the masters belong to the optimizers, not to a pickle
        return {"_names": None, "mode": self.mode}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(mode=state.get("mode", "masters"))


def gradient_of(param: torch.Tensor) -> torch.Tensor | None:
    """A parameter's gradient as its optimizer steps on it: for an FP16 parameter whose gradient moved
    into its FP32 master, the master's (FP32); otherwise `param.grad`."""
    grad = param.grad
    if isinstance(grad, GradientInMaster):
        pair = grad.__dict__.get("_hf_pair")
        pair = pair() if pair is not None else None
        return pair.fp32_grad() if pair is not None and pair.marker_is(grad) else None
    return grad


def grad_for(optimizer: Any, param: torch.Tensor) -> torch.Tensor | None:
    """The gradient one of the optimizer's parameters holds this step: its `.grad`, or, for a master
    whose FP16 gradient was read but not cast (`prepare(defer=True)`), that FP16 gradient as it was read
    (scaled; the step casts it times its factor)."""
    grad = param.grad
    if grad is not None and not isinstance(grad, PendingGradient):
        return grad
    found = masters_of(optimizer)
    if found is None:
        return None
    pair = found.by_master.get(id(param))
    return pair.live_pending() if pair is not None and pair.master is param else None


def half_of(optimizer: Any, param: torch.Tensor) -> torch.Tensor | None:
    """The FP16 parameter whose master `param` is, in this optimizer (None otherwise)."""
    found = masters_of(optimizer)
    return found.half_of(param) if found is not None else None
