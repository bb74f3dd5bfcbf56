"""An FP16 parameter and its FP32 master (`Pair`), and the stand-ins its gradient leaves behind.

The gradient has one home: a backward collects it on the FP16 parameter; the first read of an
iteration moves it into the master's FP32 `.grad` and leaves a `GradientInMaster` marker on the
FP16 parameter whose values are the master's gradient. Until the step reads it, a gradient the
scaler checked but did not cast is a `PendingGradient` on the master. See `masters.weights` for
the whole design.

Imports only torch.
"""

from __future__ import annotations

import functools
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "COMPENSATION_KEY", "GradientInMaster", "HALF_DTYPES", "MODES", "Pair", "PendingGradient", "RNG_KEY",
    "STATE_KEY", "agrees", "cast_chunk", "extra_bytes", "never_stepped",
]  # fmt: skip

HALF_DTYPES = (torch.float16,)
STATE_KEY = "hf_lossscale_master"
COMPENSATION_KEY = "hf_lossscale_compensation"  # master_weights="kahan": the FP16 compensation buffer
RNG_KEY = "hf_lossscale_rng"  # master_weights="stochastic_rounding": the generator's state, per device
#: How the weight the optimizer updates is held (see `masters.step`): `config.master_weights` True or
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
        if _sets_data(func) and isinstance(args[0], GradientInMaster):
            _follow_cast(args[0], args[1])
            return None
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


def _pending_pair(marker: PendingGradient, zero: bool = False) -> Pair | None:
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


def _sets_data(func: Any) -> bool:
    return (
        getattr(func, "__name__", "") == "__set__"
        and getattr(getattr(func, "__self__", None), "__name__", "") == "data"
    )


def _follow_cast(marker: GradientInMaster, cast: torch.Tensor) -> None:
    """`model.float()` (`.half()`, `.to(dtype or device)`) on a parameter whose `.grad` is a marker: torch
    sets the cast gradient (`cast`, the master's cast) as the marker's `.data`. The marker takes the
    new dtype and device and stays a marker (the gradient stays in the master), and the parameter's new
    gradient accumulator is hooked, so that a backward on top of the marker still adds onto the master."""
    base = torch.empty((), dtype=cast.dtype, device=cast.device)
    with torch._C.DisableTorchFunctionSubclass():
        marker.data = base.expand(marker.shape)
    pair = marker.__dict__.get("_hf_pair")
    pair = pair() if pair is not None else None
    rehook = pair.rehook() if pair is not None and pair.rehook is not None else None
    if rehook is not None:
        rehook(pair)


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
class Pair:
    """One FP16 parameter and its FP32 master, with what the hand-over needs to know."""

    half: torch.nn.Parameter
    master: torch.nn.Parameter
    name: str | None = None
    version: tuple[int, int] = (0, 0)  # the FP16 weight's (version, address) after our last write
    on_top: bool = False  # a backward came in on top of a marker: its FP16 gradient adds onto the master's
    # a master read from a state, checked against the weight at the next step
    loaded: torch.Tensor | None = None
    accumulator: Any = field(default=None, repr=False)  # the FP16 parameter's AccumulateGrad node
    rehook: Any = field(default=None, repr=False)  # a weak method: hooks the parameter's accumulator again
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
        grad = pending.to(torch.float32, copy=True)  # an FP32 one (after `model.float()`) is left as it is
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


def never_stepped(state: dict) -> bool:
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


def extra_bytes(pair: Pair) -> int:
    if pair.compensation is not None:
        return pair.compensation.numel() * pair.compensation.element_size()
    return 0 if pair.shell else pair.master.numel() * pair.master.element_size()


def cast_chunk(
    grad: torch.Tensor, factor: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A chunk of a pending FP16 gradient in FP32, times its factor: the values the gradient would hold
    cast into the master and unscaled there (the same two roundings); a copy (into `out`, an FP32
    tensor of its elements, where given), also of an FP32 one (the gradient of a model cast with
    `model.float()`), which the unscale must not write into."""
    if out is None:
        out = grad.to(torch.float32, copy=True)
    else:
        out = (out if out.shape == grad.shape else out.view(grad.shape)).copy_(grad)
    return out if factor is None else out.mul_(factor)


def agrees(pair: Pair, loaded: torch.Tensor) -> torch.Tensor:
    """Whether a loaded entry belongs to the FP16 weight: a master rounds to it; a compensation is at most
    half the FP16 spacing at the weight, on its side (a 0-d bool tensor)."""
    if pair.compensation is None:
        return (loaded.to(pair.half.dtype) == pair.half).all()
    toward = torch.where(loaded > 0, float("inf"), float("-inf")).to(pair.half.dtype)
    spacing = (torch.nextafter(pair.half, toward).float() - pair.half.float()).abs()
    return (loaded.float().abs() <= spacing / 2).all()
