"""FP32 master weights for trainable FP16 parameters: the classic design of loss scaling.

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

import functools
import itertools
import sys
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .master_kernel import OnePassSlot, one_pass_reason, run_one_pass
from .master_step import (
    BUCKET_ELEMENTS,
    Slot,
    adam_state,
    chunkable,
    kahan_split,
    round_stochastic,
    run_chunked,
)
from .optimizer_wrappers import inner_optimizer as _inner

__all__ = [
    "MasterWeights",
    "OptimizerMasters",
    "GradientInMaster",
    "HALF_DTYPES",
    "STATE_KEY",
    "masters_of",
    "half_of",
    "gradient_of",
    "grad_for",
]

HALF_DTYPES = (torch.float16,)
STATE_KEY = "hf_lossscale_master"
COMPENSATION_KEY = "hf_lossscale_compensation"  # master_weights="kahan": the FP16 compensation buffer
RNG_KEY = "hf_lossscale_rng"  # master_weights="stochastic_rounding": the generator's state, per device
#: How the weight the optimizer updates is held (see `master_step`): `config.master_weights` True or
#: "auto" mean "masters".
MODES = ("masters", "kahan", "stochastic_rounding")
_ATTR = "_hf_lossscale_masters"  # the optimizer's own attribute holding its OptimizerMasters
_CHECKED = (
    "_hf_lossscale_fp16_checked"  # for an optimizer without masters: (its layout, its frozen FP16 params)
)

_REMEDY = "A gradient is read with `scaler.master_weights.grad(optimizer, param)` too."
# metadata a caller may read off a marker (torch's own `zero_grad` and grouping read these)
_METADATA = frozenset({
    "device", "dtype", "shape", "is_sparse", "layout", "grad_fn", "requires_grad", "is_leaf", "ndim",
    "is_cuda", "is_cpu", "is_meta", "is_nested", "is_quantized", "_base", "is_mkldnn",
})  # fmt: skip


_METADATA_METHODS = frozenset({
    torch.Tensor.size, torch.Tensor.numel, torch.Tensor.dim, torch.Tensor.element_size, torch.Tensor.nelement,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.get_device, torch.Tensor.__len__,
})  # fmt: skip


class _StandIn(torch.Tensor):
    """A broadcast view standing in for a gradient held elsewhere. Its metadata reads as a tensor's
    (torch's `zero_grad` and grouping read it), `requires_grad_`/`detach_` leave it be, and zeroing it
    (`zero_()`, `_foreach_zero_`) zeroes what it stands for (`_zero_held`)."""

    @classmethod
    def _zero_held(cls, stand_in: torch.Tensor) -> None:
        raise NotImplementedError

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        answered, result = cls._answer(func, args, kwargs)
        return result if answered else cls._otherwise(func, args, kwargs)

    @classmethod
    def _otherwise(cls, func: Any, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    @classmethod
    def _answer(cls, func: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """(True, the result) for the calls every stand-in answers itself; (False, None) otherwise."""
        name = getattr(func, "__name__", "")
        metadata = name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA
        if metadata or func in _METADATA_METHODS:
            with torch._C.DisableTorchFunctionSubclass():
                return True, func(*args, **kwargs)
        if func in (torch.Tensor.requires_grad_, torch.Tensor.detach_):
            return True, args[0]
        if func is torch.Tensor.zero_:
            cls._zero_held(args[0])
            return True, args[0]
        if func is torch._foreach_zero_:
            plain = [t for t in args[0] if not isinstance(t, cls)]
            for t in args[0]:
                if isinstance(t, cls):
                    cls._zero_held(t)
            if plain:
                torch._foreach_zero_(plain)
            return True, None
        return False, None


class GradientInMaster(_StandIn):
    """What an FP16 parameter's `.grad` holds once its gradient moved into its FP32 master: a 2-byte
    stand-in (a broadcast view) of the right shape and dtype. Its values are the master's gradient:
    reading them (a norm, a log, `get_total_norm`) reads the master's FP32 gradient, and writing them
    in place (`clip_grad_value_`, `clip_grad_norm_(model.parameters())`, a hook's `mul_`) writes it,
    as with FP32 weights, where the model's parameter and the optimizer's are one tensor. Zeroing it
    (`zero_grad(set_to_none=False)`) zeroes the master's gradient; dropping it (`zero_grad()`) frees the
    master's gradient; a backward on top of it accumulates onto the master's gradient."""

    @classmethod
    def _zero_held(cls, stand_in: torch.Tensor) -> None:
        _zero_master_grad(stand_in)

    @classmethod
    def _otherwise(cls, func: Any, args: tuple, kwargs: dict) -> Any:
        args, kwargs = torch.utils._pytree.tree_map_only(GradientInMaster, _master_grad, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return f"GradientInMaster(shape={tuple(self.shape)}, dtype={self.dtype}: the gradient is in the FP32 master)"


class PendingGradient(_StandIn):
    """What a master's `.grad` holds while its gradient waits in FP16 (`gather(defer=True)`): a 4-byte
    stand-in (a broadcast view) of the right shape and dtype. Reading its values casts the FP16 gradient
    into a real FP32 `.grad` first (times its factor: what `unscale_` and the clip made of it), so a
    caller who reads the masters' gradients whole sees what it would see with FP32 weights; zeroing
    it zeroes the pending gradient; the scaler and the chunked step read the FP16 one directly."""

    @classmethod
    def _zero_held(cls, stand_in: torch.Tensor) -> None:
        _pending_pair(stand_in, zero=True)

    @classmethod
    def _otherwise(cls, func: Any, args: tuple, kwargs: dict) -> Any:
        args, kwargs = torch.utils._pytree.tree_map_only(PendingGradient, _real, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return f"PendingGradient(shape={tuple(self.shape)}: an FP16 gradient the step casts chunk by chunk)"


def _pending_pair(marker: PendingGradient, zero: bool = False) -> _Pair | None:
    pair = marker.__dict__.get("_hf_pair")
    pair = pair() if pair is not None else None
    if pair is None or pair.master.grad is not marker:
        return None
    if zero and pair.live_pending() is not None:
        pair.pending.zero_()
    return pair


def _real(marker: PendingGradient) -> torch.Tensor:
    """The FP32 gradient a pending stand-in stands for, made real on its master (read whole)."""
    pair = _pending_pair(marker)
    if pair is None:
        raise RuntimeError(
            "This stand-in of a master's pending gradient is stale: read the master's `.grad` again."
        )
    pair.materialise()
    return pair.master.grad


def _master_grad(marker: GradientInMaster) -> torch.Tensor:
    """The FP32 gradient a marker stands for (a pending one made real first)."""
    pair = marker.__dict__.get("_hf_pair")
    pair = pair() if pair is not None else None
    if (
        pair is None
        or not pair.marker_is(marker)
        or (pair.master.grad is None and pair.live_pending() is None)
    ):
        raise RuntimeError(
            "This FP16 parameter's `.grad` stands for a gradient of its FP32 master (hf_lossscale master "
            "weights) that is gone (the optimizer's gradients were cleared, or a newer one replaced it): "
            f"read the parameter's `.grad` again. {_REMEDY}"
        )
    pair.materialise()
    return pair.master.grad


def _zero_master_grad(marker: GradientInMaster) -> None:
    pair = marker.__dict__.get("_hf_pair")
    pair = pair() if pair is not None else None
    if pair is not None and pair.marker_is(marker):
        if pair.master.grad is not None:
            pair.master.grad.zero_()
        if pair.live_pending() is not None:
            pair.pending.zero_()


@dataclass(eq=False)
class _Pair:
    """One FP16 parameter and its FP32 master, with what the hand-over needs to know."""

    half: torch.nn.Parameter
    master: torch.nn.Parameter
    name: str | None = None
    version: tuple[int, int] = (0, 0)  # the FP16 weight's (version, address) after our last write
    on_top: bool = False  # a backward came in on top of a marker: its FP16 gradient adds onto the master's
    # a master read from a state, checked against the weight at the next step
    loaded: torch.Tensor | None = None
    accumulator: Any = field(default=None, repr=False)  # the FP16 parameter's AccumulateGrad node
    # master_weights="kahan": what rounding the weight lost (FP16); "kahan" and "stochastic_rounding"
    # keep no FP32 master: `master` is then a stand-in of the right shape (one stored element) that the
    # optimizer holds (its state's key) and the chunked update reads and writes around
    compensation: torch.Tensor | None = None
    shell: bool = False
    dtype: torch.dtype = (
        torch.float16
    )  # the weight's dtype at our last write (a cast of the model changes it)
    stash: torch.Tensor | None = field(default=None, repr=False)  # the gradient, during the chunked step
    # the FP16 gradient itself, read but not cast (`gather(defer=True)`): the chunked step casts it a
    # chunk at a time, times `factor` (the unscale, and clip, multiplier; None: still scaled)
    pending: torch.Tensor | None = field(default=None, repr=False)
    factor: torch.Tensor | None = field(default=None, repr=False)
    # what a fused kernel divided the gradient by (it writes the quotient back, as torch's fused
    # optimizers do with FP32 gradients): reads after such a step see the quotient
    divisor: torch.Tensor | None = field(default=None, repr=False)
    _stand_in: weakref.ref | None = field(default=None, repr=False)
    written: bool = False  # the chunked step wrote the FP16 weight
    _marker: weakref.ref | None = field(default=None, repr=False)
    # a backward's FP16 gradient still on the FP16 parameter, with a stand-in on the master saying so: a
    # `p.grad = None` (or a tensor of one's own) on the optimizer's parameter before the first read drops
    # it there, as it would drop an FP32 parameter's gradient
    early: bool = False

    def live_pending(self) -> torch.Tensor | None:
        """The pending FP16 gradient while the master's `.grad` (or the step's stash of it) still holds
        its stand-in; once someone replaced or dropped that `.grad` (`p.grad = None`, a tensor of their
        own), the pending gradient is gone with it, as an FP32 gradient would be."""
        if self.pending is None:
            return None
        stand_in = self._stand_in() if self._stand_in is not None else None
        if stand_in is not None and (self.master.grad is stand_in or self.stash is stand_in):
            return self.pending
        self.pending = self.factor = self.divisor = self._stand_in = None
        return None

    def fp32_grad(self) -> torch.Tensor | None:
        """The gradient as the optimizer steps on it (FP32), without moving anything."""
        pending = self.live_pending()
        if pending is None:
            return self.master.grad
        grad = pending.float()
        if self.factor is not None:
            grad.mul_(self.factor)
        if self.divisor is not None:
            grad.div_(self.divisor)
        return grad

    def materialise(self) -> None:
        """A pending FP16 gradient cast into the master's `.grad` (someone reads it whole)."""
        if self.live_pending() is not None:
            with torch.no_grad():
                grad = self.fp32_grad()
            self.pending = self.factor = self.divisor = self._stand_in = None
            self.master.grad = grad
            if self.early:  # it was still on the FP16 parameter: its home is the master now
                self.early = False
                self.leave_marker()

    def defer(self, grad: torch.Tensor) -> None:
        """Keep the FP16 gradient as it is; the master's `.grad` gets a stand-in (`PendingGradient`)."""
        self.pending, self.factor, self.divisor = grad, None, None
        base = torch.empty((), dtype=self.master.dtype, device=self.master.device)
        stand_in = base.expand(self.master.shape).as_subclass(PendingGradient)
        stand_in.__dict__["_hf_pair"] = weakref.ref(self)
        self._stand_in = weakref.ref(stand_in)
        self.master.grad = stand_in

    def drop(self) -> None:
        self.master.grad = None
        self.pending = self.factor = self.divisor = self._stand_in = None
        self.early = False

    def collect_early(self) -> bool:
        """At the first read of an iteration, a gradient still on the FP16 parameter: False when its
        stand-in left the master (the caller then has nothing to collect from the FP16 side: the FP16
        gradient is dropped, and a gradient set on the master by hand stays its own)."""
        self.early = False
        if self.live_pending() is not None:
            self.pending = self.factor = self.divisor = self._stand_in = None
            self.master.grad = None
            return True
        self.half.grad = None
        if self.master.grad is not None:
            self.leave_marker()
        return False

    def marker_is(self, tensor: Any) -> bool:
        return tensor is not None and self._marker is not None and self._marker() is tensor

    def weight_version(self) -> tuple[int, int]:
        return (self.half._version, self.half.data_ptr())

    def leave_marker(self) -> None:
        """Put a fresh marker on the FP16 parameter; when it dies (a `zero_grad()` on the model) the
        master's gradient goes with it, unless a backward came in on top of it."""
        half = self.half
        base = torch.empty((), dtype=half.dtype, device=half.device)
        marker = base.expand(half.shape).as_subclass(GradientInMaster)
        me = weakref.ref(self)  # weak both ways: the pair (and its master) dies with its optimizer
        marker.__dict__["_hf_pair"] = me
        self._marker = weakref.ref(marker, functools.partial(_marker_died, me))
        half.grad = marker


def _never_stepped(state: dict) -> bool:
    step = state.get("step")
    return step is not None and float(step) == 0.0


def _marker_died(pair_ref: weakref.ref, ref: weakref.ref) -> None:
    """The FP16 side dropped its gradient (`zero_grad()`): the master's goes too, unless a backward
    came in on top of it (the hook dropped the marker) or the pair has a newer marker."""
    if sys.is_finalizing():  # the interpreter is exiting: nothing to free, and torch may be half gone
        return
    pair = pair_ref()
    if pair is not None and ref is pair._marker and not pair.on_top:
        pair._marker = None
        pair.drop()


class OptimizerMasters:
    """The masters of one optimizer (see the module docstring); kept as an attribute of the optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, mode: str = "masters") -> None:
        if mode not in MODES:
            raise ValueError(f"master_weights mode {mode!r} is not one of {MODES}.")
        self.mode = mode
        self.pairs: dict[int, _Pair] = {}  # id(FP16 parameter) -> pair (the pair holds the parameter)
        self.by_master: dict[int, _Pair] = {}  # id(master) -> pair
        # the groups' lengths when the FP16 parameters were last looked for
        self._layout: tuple[int, ...] = ()
        self._frozen: list[torch.nn.Parameter] = []  # FP16 parameters left in the groups (frozen then)
        self._hook_handles: list[Any] = []  # the FP16 parameters' gradient hooks
        self._loaded = False  # masters were loaded from a state and await their check (`take_loaded`)
        self.generators: dict[torch.device, torch.Generator] = {}  # "stochastic_rounding"
        self._loaded_rng: dict[torch.device, torch.Tensor] = {}
        self._work: list[tuple[dict, list[_Pair]]] | None = None  # the chunked step under way
        ref = weakref.ref(self)
        # `optimizer.zero_grad()` clears the FP16 gradients not yet read into the masters, too (its groups
        # hold the masters): the one method wrapped, on this instance; torch has no hook for it
        # (the optimizer held weakly: no reference cycle keeps it, or its masters, alive after `del`)
        original = optimizer.__dict__.get("zero_grad")
        original = original if original is not None else functools.partial(type(optimizer).zero_grad)
        optimizer.zero_grad = functools.partial(_zero_grad, original, weakref.ref(optimizer), ref)
        # an optimizer that moves its parameters itself outside `step()` (schedule-free's `eval()` and
        # `train()`, which the Trainer calls around evaluation) moves the masters: the FP16 weights follow
        for mode_switch in ("eval", "train"):
            own = getattr(optimizer, mode_switch, None)
            if callable(own) and not isinstance(own, functools.partial):
                setattr(optimizer, mode_switch, functools.partial(_then_write_back, own, ref))
        optimizer.register_state_dict_post_hook(functools.partial(_state_dict_hook, ref))
        optimizer.register_load_state_dict_pre_hook(functools.partial(_load_pre_hook, ref))
        optimizer.register_load_state_dict_post_hook(functools.partial(_load_post_hook, ref))
        # the update of the FP16 parameters runs chunk by chunk (`master_step`) between torch's step hooks:
        # their gradients are out of sight of torch's algorithm while it runs (it updates the others)
        self._pre = optimizer.register_step_pre_hook(functools.partial(_before_step, ref))
        self._post = optimizer.register_step_post_hook(functools.partial(_after_step, ref))
        # not at interpreter exit: nothing needs releasing then, and torch may be half torn down
        weakref.finalize(self, _release, self.pairs, self._hook_handles).atexit = False

    # ------------------------------------------------------------------ which parameters
    def sync_params(
        self, optimizer: torch.optim.Optimizer, name: Callable[[torch.Tensor], str | None]
    ) -> int:
        """Masters for trainable FP16 parameters in the groups that have none yet (a new group, an
        unfrozen one); returns how many were made. Cheap when nothing changed."""
        layout = tuple(len(g["params"]) for g in optimizer.param_groups)
        if layout == self._layout and not any(p.requires_grad for p in self._frozen):
            return 0
        made = 0
        frozen = []
        present = {id(p) for g in optimizer.param_groups for p in g["params"]}
        with torch.no_grad():
            for group in optimizer.param_groups:
                params = group["params"]
                for i, p in enumerate(params):
                    if p.dtype not in HALF_DTYPES:
                        continue
                    if not p.requires_grad:
                        frozen.append(p)
                        continue
                    pair = self.pairs.get(id(p))
                    if pair is None:
                        pair = self._new_pair(optimizer, p, name(p))
                        made += 1
                    elif id(pair.master) in present:
                        raise ValueError(
                            f"master_weights: {pair.name or 'an FP16 parameter'} is in the optimizer already "
                            "(as its FP32 master): some parameters appear in more than one parameter group, "
                            "which torch's optimizers refuse."
                        )
                    params[i] = pair.master
        self._frozen = frozen
        self._layout = layout
        return made

    def _new_pair(
        self, optimizer: torch.optim.Optimizer, half: torch.nn.Parameter, name: str | None
    ) -> _Pair:
        label = name or f"<FP16 parameter of shape {tuple(half.shape)}>"
        kind = type(half).__name__
        if kind in ("DTensor", "FlatParameter"):
            raise ValueError(
                f"master_weights: the optimizer holds sharded FP16 parameters ({kind}): under FSDP keep "
                "the parameters in FP32 and let FSDP compute in FP16 (FSDP2 `MixedPrecisionPolicy(param_dtype="
                "torch.float16)`, FSDP1 `MixedPrecision(param_dtype=torch.float16)`), which is the same design; "
                "under DeepSpeed use its FP16 optimizer (`fp16.enabled`), which keeps FP32 masters itself."
            )
        if self.mode != "masters":
            group = next(g for g in optimizer.param_groups if any(q is half for q in g["params"]))
            why = chunkable(optimizer, group)
            if why is not None:
                raise ValueError(
                    f"master_weights={self.mode!r} updates the FP16 weights itself, with torch's Adam, AdamW or SGD "
                    f"arithmetic chunk by chunk: not with {why}. Use master_weights=True (FP32 masters) there."
                )
        state = optimizer.state.get(half)
        adagrad_step = None
        if state and isinstance(optimizer, torch.optim.Adagrad) and _never_stepped(state):
            # Adagrad makes its state in its constructor, in the parameter's dtype: the master's is made
            # below as Adagrad makes it for an FP32 parameter (its step counter kept)
            adagrad_step = optimizer.state.pop(half)["step"]
            state = None
        fp32_state = state and all(
            v.dtype == torch.float32
            for k, v in state.items()
            if isinstance(v, torch.Tensor) and k != "step" and v.is_floating_point()
        )
        if state and fp32_state and STATE_KEY not in state:
            # stepped while the parameter was FP32 (then `model.half()`): its FP32 state is the master's
            master = torch.nn.Parameter(half.detach().float())
            optimizer.state[master] = optimizer.state.pop(half)
            state = None
        else:
            master = None
        if state:
            if any(k in state for k in (STATE_KEY, COMPENSATION_KEY, RNG_KEY)):
                raise ValueError(
                    f"master_weights: {label}: this optimizer's state was loaded before its FP32 masters "
                    "existed, so torch cast the masters and the moments to float16. Give the optimizer to "
                    "the scaler first: `scaler.master_weights.attach(optimizer)` (the Trainer and "
                    "`accelerator.prepare` do it), then `optimizer.load_state_dict(...)`."
                )
            raise ValueError(
                f"master_weights: {label} already has optimizer state (the optimizer stepped on FP16 "
                "weights): attach the masters before the first step."
            )
        shell = self.mode != "masters"
        if shell:
            stand_in = torch.zeros((), dtype=torch.float32, device=half.device).expand(half.shape)
            if master is None:
                master = torch.nn.Parameter(stand_in)
            else:  # the FP32 state of a phase with FP32 weights, kept
                master.data = stand_in
        if master is None:
            master = torch.nn.Parameter(half.detach().float())
        if adagrad_step is not None:
            init = optimizer.defaults["initial_accumulator_value"]
            optimizer.state[master] = {"step": adagrad_step, "sum": torch.full_like(master, init)}
        pair = _Pair(half=half, master=master, name=name, shell=shell, dtype=half.dtype)
        if self.mode == "kahan":
            pair.compensation = torch.zeros_like(half, memory_format=torch.contiguous_format)
        if self.mode == "stochastic_rounding" and half.device not in self.generators:
            gen = torch.Generator(device=half.device)
            # seeded from the process's seed (`torch.manual_seed`), without drawing from its stream: the
            # same training built twice in one process rounds the same way
            gen.manual_seed((torch.initial_seed() + 0x5EED) % 2**63)
            self.generators[half.device] = gen
        pair.version = pair.weight_version()
        self.pairs[id(half)] = pair
        self.by_master[id(master)] = pair
        me = weakref.ref(pair)
        with torch.enable_grad():  # the parameter's gradient accumulator, kept (as DDP keeps it)
            pair.accumulator = half.view_as(half).grad_fn.next_functions[0][0]
        # on the accumulator, not the tensor: `torch.autograd.grad` (which accumulates nothing) leaves it be
        self._hook_handles.append(pair.accumulator.register_prehook(functools.partial(_on_new_gradient, me)))
        self._hook_handles.append(
            half.register_post_accumulate_grad_hook(functools.partial(_fold_on_top, me))
        )
        return pair

    # ------------------------------------------------------------------ each step
    def gather(self, optimizer: torch.optim.Optimizer | None = None, defer: bool = False) -> None:
        """Move this iteration's FP16 gradients into the masters (one read each; see the module docstring),
        and bring the masters in line with weights written from outside. `defer` (with the optimizer):
        where the update runs chunk by chunk, the FP16 gradients are taken as they are (`pending`), to be
        cast a chunk at a time inside the step: no FP32 gradient for every parameter at once."""
        self._refresh_masters()
        deferred = self._chunked_masters(optimizer) if defer and optimizer is not None else set()
        fresh_src, fresh_dst, fresh_pairs = [], [], []
        fresh = 0

        def hand_over() -> None:
            # a bucket at a time, each FP16 gradient freed as soon as it is cast: never all the FP16 and
            # all the FP32 gradients at once
            with torch.no_grad():
                torch._foreach_copy_(fresh_dst, fresh_src)
            fresh_src.clear()
            for pair, dst in zip(fresh_pairs, fresh_dst, strict=True):
                pair.master.grad = dst
                pair.on_top = False
                pair.leave_marker()
            fresh_dst.clear()
            fresh_pairs.clear()

        for pair in self.pairs.values():
            grad = pair.half.grad
            if pair.early and grad is not None and not isinstance(grad, GradientInMaster):
                if not pair.collect_early():
                    continue
            if grad is None:
                pair.drop()
                pair.on_top = False
            elif isinstance(grad, GradientInMaster):
                if not pair.marker_is(grad):  # another optimizer's master holds it: none here
                    pair.drop()
                elif pair.master.grad is None and pair.live_pending() is None:
                    # the master's gradient was cleared by hand (`p.grad = None` on the optimizer's
                    # parameter): the model's parameter has none either, as with FP32 weights
                    pair._marker = None
                    pair.half.grad = None
                elif id(pair.master) not in deferred:
                    pair.materialise()
                continue
            elif grad.is_sparse:  # a sparse embedding's: cast as it is (FP32 sparse)
                pair.master.grad = grad.coalesce().float() if pair.master.grad is None or not pair.on_top else (
                    pair.master.grad + grad.float())  # fmt: skip
                pair.on_top = False
                pair.leave_marker()
            elif pair.on_top and pair.master.grad is not None:
                with torch.no_grad():
                    pair.master.grad.add_(grad)
                pair.on_top = False
                pair.leave_marker()
            elif id(pair.master) in deferred:
                pair.defer(grad)
                pair.on_top = False
                pair.leave_marker()
            else:
                fresh_src.append(grad)
                fresh_dst.append(torch.empty(grad.shape, dtype=torch.float32, device=grad.device))
                fresh_pairs.append(pair)
                fresh += grad.numel()
                if fresh >= BUCKET_ELEMENTS:
                    hand_over()
                    fresh = 0
            del grad
        if fresh_pairs:
            hand_over()

    def order_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        """Ours last among the optimizer's step pre-hooks and first among its post-hooks, so that a hook
        of yours, whenever registered, sees the gradients before the step and the updated weights after
        it, as with FP32 weights (torch keeps the hooks in ordered dicts, in registration order)."""
        pre, post = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
        if self._pre.id in pre:
            pre.move_to_end(self._pre.id)
        if self._post.id in post:
            post.move_to_end(self._post.id, last=False)

    def _chunked_masters(self, optimizer: torch.optim.Optimizer) -> set[int]:
        """The masters whose update runs chunk by chunk (their groups' options allow it)."""
        return {id(p) for g in optimizer.param_groups if chunkable(optimizer, g) is None for p in g["params"]}

    def pending(self) -> list[torch.Tensor]:
        """The FP16 gradients read but not cast (scaled, or as `set_factor` left them)."""
        return [g for p in self.pairs.values() if (g := p.live_pending()) is not None]

    def set_factor(self, factor: torch.Tensor) -> None:
        """The multiplier (the scale's reciprocal, times a clip coefficient) the pending gradients take
        when they are cast."""
        for pair in self.pairs.values():
            if pair.live_pending() is not None:
                pair.factor = factor if pair.factor is None else pair.factor * factor

    def materialise(self) -> None:
        for pair in self.pairs.values():
            pair.materialise()

    def take_loaded(self, final: bool) -> None:
        """Masters loaded from a state that round to their FP16 weights replace the masters; the others
        wait (the weights may be loaded next) or, when `final`, are rebuilt from the weights with a
        warning that names the parameter."""
        if not self._loaded:  # nothing loaded since the last check: no pass over the pairs
            return
        for device, rng in self._loaded_rng.items():
            gen = self.generators.get(device)
            if gen is not None:
                gen.set_state(rng)
        self._loaded_rng = {}
        loaded = [p for p in self.pairs.values() if p.loaded is not None]
        self._loaded = not final  # a mismatch may wait for the weights; the next step's check settles it
        if loaded:
            with torch.no_grad():
                agree = torch.stack([_agrees(p, p.loaded) for p in loaded]).tolist()
                for pair, ok in zip(loaded, agree, strict=True):
                    # a compensation belongs to the weights of the step: taken only then (the model's
                    # weights may be loaded after the optimizer's state)
                    if not final and (not ok or pair.compensation is not None):
                        continue
                    if pair.compensation is not None:  # "kahan": the buffer, or none
                        pair.compensation.copy_(pair.loaded) if ok else pair.compensation.zero_()
                    else:
                        pair.master.copy_(pair.loaded if ok else pair.half)
                    if not ok:
                        warnings.warn(
                            f"master_weights: the {'compensation' if pair.shell else 'FP32 master'} loaded for {pair.name or 'a parameter of shape '}"
                            f"{'' if pair.name else tuple(pair.half.shape)} does not round to its FP16 weight "
                            "(a stale entry, from before a phase that trained the weights without masters, or a "
                            "corrupted file): " + ("dropped." if pair.shell else "rebuilt from the weight."),
                            stacklevel=5,
                        )
                    pair.loaded = None
                    pair.version = pair.weight_version()

    def _refresh_masters(self) -> None:
        """Masters loaded from a state are checked against their weights; weights written from outside
        since our last write are read into their masters."""
        self.take_loaded(final=True)
        self.follow_weights()

    def follow_weights(self) -> None:
        """Weights written from outside since our last write (their version counter moved) are read
        into their masters. A cast of the model (`model.float()`, `.to(torch.bfloat16)`) is not a write:
        the masters carry on, and the weights are them in the new dtype from the next write on."""
        for pair in self.pairs.values():
            if pair.weight_version() != pair.version:
                if pair.half.dtype != pair.dtype and self._cast_of_ours(pair):
                    pair.dtype = pair.half.dtype
                    with torch.no_grad():
                        pair.half.copy_(pair.master)  # FP32: the master itself; BF16: it rounded
                    pair.version = pair.weight_version()
                    continue
                with torch.no_grad():
                    if pair.compensation is not None:  # the weight written is the value: nothing to carry
                        pair.compensation.zero_()
                    elif not pair.shell:
                        pair.master.copy_(pair.half)
                pair.version = pair.weight_version()

    def _cast_of_ours(self, pair: _Pair) -> bool:
        """Whether the weight, in a dtype it did not have, is our last FP16 write cast (not new values)."""
        if pair.shell:
            raise ValueError(
                f"master_weights={self.mode!r} keeps no FP32 master and updates the weights in "
                f"{pair.dtype} itself: {pair.name or 'a parameter'} is now {pair.half.dtype} (the model was "
                "cast mid-run). Cast the model before its first step, or use master_weights=True."
            )
        with torch.no_grad():
            return bool(torch.equal(pair.master.to(pair.dtype).to(pair.half.dtype), pair.half))

    def write_back(self) -> None:
        """The FP16 weights from the masters (round to nearest even), where the chunked step has not
        written them already."""
        pairs = []
        for pair in self.pairs.values():
            if pair.written or pair.shell:
                pair.written = False
                pair.version = pair.weight_version()
            else:
                pairs.append(pair)
        if not pairs:
            return
        with torch.no_grad():
            torch._foreach_copy_([p.half for p in pairs], [p.master for p in pairs])
        for pair in pairs:
            pair.version = pair.weight_version()

    # ------------------------------------------------------------------ the chunked step
    def set_aside(self, optimizer: torch.optim.Optimizer) -> None:
        """Before torch's algorithm runs: the gradients of the pairs whose update runs chunk by chunk are
        taken out of its sight (it updates the optimizer's other parameters)."""
        self.restore()
        work = []
        seen: set[int] = set()  # pairs already taken (a parameter listed twice: torch warns; updated once)
        for group in optimizer.param_groups:
            if chunkable(optimizer, group) is not None:
                continue
            taken = []
            for param in group["params"]:
                pair = self.by_master.get(id(param))
                if pair is None or pair.master is not param or id(pair) in seen:
                    continue
                pending = pair.live_pending()
                if pending is None and (param.grad is None or param.grad.is_sparse):
                    if pair.shell and param.grad is not None:
                        raise ValueError(
                            f"master_weights={self.mode!r}: {pair.name or 'an FP16 parameter'} has a sparse "
                            "gradient, which the chunked update does not take: use master_weights=True (FP32 "
                            "masters) for a model with sparse gradients."
                        )
                    continue
                pair.stash, param.grad = param.grad, None
                taken.append(pair)
                seen.add(id(pair))
            if taken:
                work.append((group, taken))
        self._work = work

    def update(self, optimizer: torch.optim.Optimizer) -> None:
        """After torch's algorithm: the pairs set aside, updated chunk by chunk with the same arithmetic
        (and `grad_scale`/`found_inf`, as the scaler hands them to a fused optimizer), and their FP16
        weights written in the same pass."""
        work, self._work = self._work, None
        if not work:
            return
        grad_scale = getattr(optimizer, "grad_scale", None)
        found_inf = getattr(optimizer, "found_inf", None)
        try:
            for group, pairs in work:
                one_pass = self._one_pass_slots(optimizer, group, pairs)
                if one_pass is not None:  # CUDA with Triton: one kernel pass per parameter
                    run_one_pass(optimizer, group, one_pass, lambda key, g=group: adam_state(optimizer, g, key),
                                 grad_scale, found_inf)  # fmt: skip
                else:
                    run_chunked(
                        optimizer, group, [self._slot(p, found_inf) for p in pairs], grad_scale, found_inf
                    )
                for pair in pairs:
                    pair.written = True
                    if grad_scale is not None and pair.live_pending() is not None:
                        # a fused kernel writes an FP32 gradient back divided (not on a step it skips)
                        skipped = found_inf is not None
                        pair.divisor = torch.where(found_inf > 0, 1.0, grad_scale) if skipped else grad_scale
        finally:
            self._work = work
            self.restore()

    def restore(self) -> None:
        """The gradients set aside, back on their masters (a step that raised leaves them there too)."""
        work, self._work = self._work, None
        for _, pairs in work or ():
            for pair in pairs:
                if pair.stash is not None:
                    pair.master.grad, pair.stash = pair.stash, None

    def _one_pass_slots(
        self, optimizer: torch.optim.Optimizer, group: dict, pairs: list[_Pair]
    ) -> list | None:
        """The kernel's slots when `master_kernel` can run this group's update (FP32 masters whose FP16
        gradients are pending, Adam/AdamW, CUDA, Triton); None otherwise."""
        if any(p.shell or p.live_pending() is None for p in pairs):
            return None
        slots = [OnePassSlot(p.master, p.pending, p.factor, p.master, p.half) for p in pairs]
        return slots if one_pass_reason(optimizer, group, slots) is None else None

    def _slot(self, pair: _Pair, found_inf: torch.Tensor | None) -> Slot:
        half, comp = pair.half, pair.compensation
        pending = pair.live_pending()
        grad = pair.stash if pending is None else pending
        factor = pair.factor if pending is not None else None
        cast = pending is not None
        flat = grad.is_contiguous() and half.is_contiguous() and (pair.shell or pair.master.is_contiguous())

        def part(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
            return t.view(-1)[a:b] if flat else t

        def kept(a: int, b: int, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
            # a step the fused kernel skipped on the device leaves the stored value bitwise as it was
            return new if found_inf is None else torch.where(found_inf > 0, old, new)

        if not pair.shell:
            master = pair.master

            def load(a: int, b: int) -> torch.Tensor:
                return part(master, a, b)

            def store(a: int, b: int, new: torch.Tensor) -> None:
                part(half, a, b).copy_(new)

        elif comp is not None:

            def load(a: int, b: int) -> torch.Tensor:
                return part(half, a, b).float() + part(comp, a, b).float()

            def store(a: int, b: int, new: torch.Tensor) -> None:
                w, c = part(half, a, b), part(comp, a, b)
                if found_inf is None:
                    kahan_split(new, w, c)
                else:
                    w16, c16 = torch.empty_like(w), torch.empty_like(c)
                    kahan_split(new, w16, c16)
                    w.copy_(kept(a, b, w16, w))
                    c.copy_(kept(a, b, c16, c))

        else:
            gen = self.generators[half.device]

            def load(a: int, b: int) -> torch.Tensor:
                return part(half, a, b).float()

            def store(a: int, b: int, new: torch.Tensor) -> None:
                w = part(half, a, b)
                w.copy_(kept(a, b, round_stochastic(new, gen), w))

        return Slot(
            key=pair.master,
            numel=half.numel(),
            flat=flat,
            grad_of=lambda a, b: _cast(part(grad, a, b), factor) if cast else part(grad, a, b),
            load=load,
            store=store,
        )

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        pair = self.pairs.get(id(param))
        return param if pair is None or pair.half is not param else pair.master

    def half_of(self, param: torch.Tensor) -> torch.Tensor | None:
        pair = self.by_master.get(id(param))
        return pair.half if pair is not None and pair.master is param else None


def _extra_bytes(pair: _Pair) -> int:
    if pair.compensation is not None:
        return pair.compensation.numel() * pair.compensation.element_size()
    return 0 if pair.shell else pair.master.numel() * pair.master.element_size()


def _cast(grad: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    """A chunk of a pending FP16 gradient in FP32, times its factor: the values the gradient would hold
    cast into the master and unscaled there (the same two roundings)."""
    out = grad.float()
    return out if factor is None else out.mul_(factor)


def _agrees(pair: _Pair, loaded: torch.Tensor) -> torch.Tensor:
    """Whether a loaded entry belongs to the FP16 weight: a master rounds to it; a compensation is at most
    half the FP16 spacing at the weight, on its side (a 0-d bool tensor)."""
    if pair.compensation is None:
        return (loaded.to(pair.half.dtype) == pair.half).all()
    toward = torch.where(loaded > 0, float("inf"), float("-inf")).to(pair.half.dtype)
    spacing = (torch.nextafter(pair.half, toward).float() - pair.half.float()).abs()
    return (loaded.float().abs() <= spacing / 2).all()


def _before_step(ref: weakref.ref, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    masters = ref()
    if masters is not None and masters.pairs:
        masters.set_aside(optimizer)


def _after_step(ref: weakref.ref, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    masters = ref()
    if masters is not None and masters._work is not None:
        masters.update(optimizer)


def _release(pairs: dict[int, _Pair], handles: list) -> None:
    """The optimizer is gone: its hooks come off the FP16 parameters, and so do its markers (a later
    backward then collects a fresh FP16 gradient)."""
    for handle in handles:
        handle.remove()
    for pair in pairs.values():
        if pair.marker_is(pair.half.grad):
            pair.half.grad = None


def _then_write_back(original: Callable, ref: weakref.ref, *args: Any, **kwargs: Any) -> Any:
    result = original(*args, **kwargs)
    masters = ref()
    if masters is not None:
        masters.take_loaded(final=True)
        masters.write_back()
    return result


def _zero_grad(original: Callable, opt_ref: weakref.ref, ref: weakref.ref, set_to_none: bool = True) -> None:
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


def _on_new_gradient(pair_ref: weakref.ref, grad_outputs: tuple) -> None:
    """A backward is about to accumulate into an FP16 parameter whose `.grad` is a marker: the marker
    goes (the new FP16 gradient is collected from zero) and `_fold_on_top` adds it onto the master's."""
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


def _fold_on_top(pair_ref: weakref.ref, half: torch.Tensor) -> None:
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


def _state_dict_hook(ref: weakref.ref, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
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


def _load_pre_hook(ref: weakref.ref, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
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


def _load_post_hook(ref: weakref.ref, optimizer: torch.optim.Optimizer) -> None:
    masters = ref()
    if masters is not None:
        masters.take_loaded(final=False)


def mode_of(setting: Any) -> str:
    """The way of holding the weights that `config.master_weights` names (True and "auto": "masters")."""
    return setting if setting in MODES[1:] else "masters"


def masters_of(optimizer: Any, create: bool = False, mode: str = "masters") -> OptimizerMasters | None:
    """The optimizer's masters (the torch optimizer inside Accelerate's wrapper), made when `create`."""
    inner = _inner(optimizer)
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
        #: "stochastic_rounding" (`config.master_weights`, see `master_step`)
        self.mode = mode_of(mode)
        self._seen: weakref.WeakSet = weakref.WeakSet()  # optimizers with masters, for `bytes()`

    @staticmethod
    def half_trainable(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
        """The optimizer's trainable parameters held in FP16 (not yet stepping on masters)."""
        return [
            p
            for g in _inner(optimizer).param_groups
            for p in g["params"]
            if p.dtype in HALF_DTYPES and p.requires_grad
        ]

    def attach(self, optimizer: torch.optim.Optimizer) -> int:
        """Masters for the optimizer's trainable FP16 parameters now (before `load_state_dict` of a
        resumed state); returns how many were made. Idempotent; a step does it by itself."""
        inner = _inner(optimizer)
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
        inner = _inner(optimizer)
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
        optimizers = [_inner(optimizer)] if optimizer is not None else list(self._seen)
        return sum(
            _extra_bytes(p)
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
