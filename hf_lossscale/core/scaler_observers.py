"""What watches a `DynamicLossScaler` without deciding anything: the observer interface it calls at
fixed points, and the two observers it ships with.

- `SkipWatch` names the parameters whose gradients were non-finite at skipped steps
  (`scaler.overflow_params`) and raises `LossScaleCollapseError` after `max_consecutive_skips`
  skipped steps in a row. It reads the device values through non-blocking host copies.
- `TelemetryWatch` feeds `GradientTelemetry` the scaled gradients every `telemetry_interval`
  iterations.

The scaler holds a list of observers; with none (as in `"off"` mode) it makes no calls. Imports only torch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from ..masters.weights import grad_for, half_of
from .distributed import local_shard
from .events import EventSink
from .hostcopy import HostCopy, tracing_or_capturing
from .overflow import display_origin
from .scaler_state import PACKED

if TYPE_CHECKING:
    from .config import LossScaleConfig
    from .scaler import DynamicLossScaler

__all__ = [
    "LossScaleCollapseError",
    "ParameterNames",
    "ScalerObserver",
    "SkipWatch",
    "TelemetryWatch",
    "collapse_message",
    "max_norms",
    "nonfinite_flags",
]

_MAX_NAMES = 8  # parameter names kept for an overflow report
_MAX_PENDING_NAMES = 4  # overflow-flag copies in flight to the host


class LossScaleCollapseError(RuntimeError):
    """Raised after `max_consecutive_skips` skipped steps in a row: the scale cannot recover.

    `origin` and `kind` (`"forward"`/`"backward"`) name the latest diagnosed overflow, when one
    was diagnosed (the Trainer's `OverflowDiagnosisCallback` does); `nonfinite_loss_steps` is how
    many of the skips in a row had a non-finite loss (forward overflows)."""

    def __init__(
        self,
        message: str,
        *,
        origin: str | None = None,
        kind: str | None = None,
        nonfinite_loss_steps: int | None = None,
    ) -> None:
        super().__init__(message)
        self.origin = origin
        self.kind = kind
        self.nonfinite_loss_steps = nonfinite_loss_steps


class ParameterNames:
    """Names of parameters for reports: those given by `add`, else their place in the optimizer."""

    def __init__(self) -> None:
        self._names: dict[int, str] = {}
        # per optimizer: its parameters' places, rebuilt when its groups change (linear, not a scan per
        # tensor: naming 60,000 tensors took 69 s that way)
        self._places: dict[int, tuple[tuple[int, ...], dict[int, tuple[int, int]]]] = {}

    def add(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, param in pairs:
            self._names[id(param)] = name

    def given(self, param: torch.Tensor) -> str | None:
        """The name `add` gave this tensor, if any."""
        return self._names.get(id(param))

    def _place(self, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> tuple[int, int] | None:
        shape = tuple(len(group["params"]) for group in optimizer.param_groups)
        cached = self._places.get(id(optimizer))
        if cached is None or cached[0] != shape:
            index = {id(p): (g, i) for g, group in enumerate(optimizer.param_groups)
                     for i, p in enumerate(group["params"])}  # fmt: skip
            cached = self._places[id(optimizer)] = (shape, index)
        place = cached[1].get(id(param))
        if place is not None:
            g, i = place
            if optimizer.param_groups[g]["params"][i] is not param:  # replaced in place: rebuild once
                self._places.pop(id(optimizer))
                return self._place(param, optimizer)
        return place

    def name(self, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> str:
        name = self._names.get(id(param))
        if name is not None:
            return name
        half = half_of(optimizer, param)  # an FP32 master: the name of its FP16 parameter
        if half is not None and id(half) in self._names:
            return self._names[id(half)]
        place = self._place(param, optimizer)
        if place is not None:
            return f"param_groups[{place[0]}].params[{place[1]}] (shape {tuple(param.shape)})"
        return f"<parameter shape {tuple(param.shape)}>"

    def grads(self, optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, gradient) for each dense gradient of the optimizer; a DTensor's local shard."""
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = grad_for(optimizer, param)  # a master's FP16 gradient not yet cast: as read
                if grad is not None and not grad.is_sparse:
                    yield self.name(param, optimizer), local_shard(grad)


def max_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Each gradient's max-norm (inf/NaN exactly when it holds an inf/NaN; 0 for an empty one), in order,
    as one float vector on the first one's device. One `_foreach_norm` per device and dtype and one
    stack where all are dense, non-empty and alike (the usual case): two device ops. No host sync."""
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

    first = grads[0].device
    dense = [g.coalesce()._values() if g.is_sparse else g for g in grads]
    keep = [i for i, g in enumerate(dense) if g.numel()]  # max-norm has no identity for an empty tensor
    with torch.no_grad():
        if not keep:
            return torch.zeros(len(grads), device=first)
        grouped = _group_tensors_by_device_and_dtype([[dense[i] for i in keep]], with_indices=True)
        parts = []
        for (device, _), ([tensors], indices) in grouped.items():
            if device.type in ("cpu", "cuda"):
                norms = torch.stack(torch._foreach_norm(tensors, float("inf")))
            else:
                norms = torch.stack([t.abs().amax() for t in tensors])
            parts.append((norms, [keep[j] for j in indices]))
        if len(parts) == 1 and len(keep) == len(grads) and parts[0][1] == keep:
            return parts[0][0].to(first)
        out = torch.zeros(len(grads), dtype=torch.float32, device=first)
        for norms, places in parts:
            out[torch.tensor(places, device=first)] = norms.to(device=first, dtype=torch.float32)
        return out


def nonfinite_flags(grads: list[torch.Tensor]) -> torch.Tensor:
    """One bool per gradient, in order, on the first one's device: does it hold inf/NaN? From
    `max_norms` (x * 0 is NaN exactly when x is inf/NaN); an empty gradient counts as finite. No host sync."""
    return max_norms(grads).mul(0).ne(0)


class ScalerObserver:
    """The points at which a `DynamicLossScaler` tells its observers what happened. Each method
    does nothing by default; none may synchronise with the device on every step.

    An observer with something to report emits it into its `sink`, an `EventSink` (hand one in to
    share it); the scaler's `drain_events()` takes what every observer recorded since the last call,
    for an event log."""

    #: Where this observer's events go; None: it reports none.
    sink: EventSink | None = None

    def drain_events(self) -> list[dict]:
        """The events this observer recorded since the last call."""
        return self.sink.drain() if self.sink is not None else []

    def before_unscale(self, scaler: DynamicLossScaler, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's gradients are about to be checked (still scaled)."""

    def on_norms(
        self,
        scaler: DynamicLossScaler,
        optimizer: torch.optim.Optimizer,
        params: list[torch.Tensor],
        norms: torch.Tensor,
    ) -> None:
        """`clip_grad_norm_` computed each parameter's gradient norm (a device vector, in `params`' order,
        of the gradients as they were, scaled): a norm is inf/NaN exactly when its gradient holds one."""

    def before_step(
        self, scaler: DynamicLossScaler, optimizer: torch.optim.Optimizer, skipped: bool | None
    ) -> None:
        """The optimizer is about to step or be skipped: `skipped` as the host knows it, or None when
        a fused kernel decides on the device."""

    def on_update(self, scaler: DynamicLossScaler, rule_applied: bool) -> None:
        """`update()` ran; `rule_applied` is False for `update(new_scale)` and in `"off"` mode."""

    def on_state_loaded(self, scaler: DynamicLossScaler) -> None:
        """`load_state_dict()` replaced the state."""


class TelemetryWatch(ScalerObserver):
    """Feeds the scaler's `telemetry` (a `GradientTelemetry`) the scaled gradients on its iterations
    and closes each iteration."""

    def before_unscale(self, scaler, optimizer):
        if scaler.telemetry.due(scaler.iteration):
            scaler.telemetry.observe(scaler.parameter_names.grads(optimizer), scaler.iteration)

    def on_update(self, scaler, rule_applied):
        scaler.telemetry.end_iteration(scaler.iteration - 1)  # the iteration update() just closed


class SkipWatch(ScalerObserver):
    """Overflow names, the collapse check and the floor event, from host copies that never make the
    step wait.

    Names are taken on every step the host knows to be skipped (the non-fused path, which reads the
    flag anyway); with fused optimizers (which decide in their kernel), for a step the counters' copy
    shows skipped, from the per-parameter norms `clip_grad_norm_` computed for it (kept until then, no
    device op), and on the steps after the first of a run of skips. The five counters are copied at
    each update (one copy) and read at the first later update where the copy has landed (on the CPU:
    at once), so on CUDA the collapse fires at the update that reaches the limit or up to one update
    later. The scale is copied, for the floor event, only while it may sit at the floor: at the first
    update, and then while a lower bound the host keeps without copies (the last scale read, backed
    off once per skip since) reaches the floor. A clean run copies the counters and nothing else, and
    so does a skip far above the floor.
    """

    def __init__(self, names: ParameterNames) -> None:
        self.names = names
        #: The scaler's counters (`PACKED`) as the last host copy that landed read them: a late view
        #: of `scaler.state.counters`, not a count of its own.
        self.counters_seen: dict[str, int] = dict.fromkeys(PACKED, 0)
        self._copy: tuple[HostCopy, int] | None = None  # the counters' copy, and the iteration it closed
        # the scale after an update (None: known above the floor), and that update's iteration
        self._scale_copies: list[tuple[HostCopy | None, int]] = []
        # a scale read on the host and the skips counted up to its update (None: unknown, so the floor
        # is possible), and the counters' reads: (iteration, skipped_steps); see _floor_possible
        self._scale_ref: tuple[float, int] | None = None
        self._ref_at = -1  # the update (the iteration it closed) after which `_scale_ref`'s scale was read
        # the scale tensor as our last update left it, (id, data_ptr, version): a write since from
        # outside (a `fill_` of `_scale`) ends what the host knows of it (see `clamp_may_bind`)
        self._scale_mark: tuple[int, int, int] | None = None
        self._skipped_reads: list[tuple[int, int]] = [(-1, 0)]
        self.steps_at_floor = 0
        self.collapse_warned = False
        self.sink = EventSink()  # `floor`, `collapse_warning`
        self._pending: list[tuple[HostCopy, torch.optim.Optimizer, list[torch.Tensor]]] = []
        # clip_grad_norm_'s per-parameter norms of the last two iterations, by iteration
        self._norms: dict[int, list[tuple[torch.optim.Optimizer, list[torch.Tensor], torch.Tensor]]] = {}
        self._named: set[tuple[int, int]] = set()  # (iteration, id(optimizer)) already sent to the host
        self.overflow_params: list[str] = []

    @property
    def known_consecutive(self) -> int:
        """Skipped steps in a row, as the last landed copy of the counters read them."""
        return self.counters_seen["consecutive_skips"]

    @property
    def known_skipped(self) -> int:
        """Skipped steps in all, as the last landed copy of the counters read them."""
        return self.counters_seen["skipped_steps"]

    # ---------------------------------------------------------------- naming
    def on_norms(self, scaler, optimizer, params, norms):
        iteration = scaler.iteration
        self._norms.setdefault(iteration, []).append((optimizer, params, norms))
        for old in [k for k in self._norms if k < iteration - 1]:
            del self._norms[old]

    def before_step(self, scaler, optimizer, skipped):
        if skipped is True or (skipped is None and self.known_consecutive > 0):
            self._queue(scaler.iteration, optimizer)

    def _queue(self, iteration: int, optimizer: torch.optim.Optimizer) -> None:
        """Send the per-parameter norms of `iteration` to the host (non-finite exactly where a gradient
        is; those `clip_grad_norm_` kept, else one read of the gradients now, only on steps known or
        likely to be skipped), once per optimizer and iteration."""
        if (iteration, id(optimizer)) in self._named:
            return
        self._named.add((iteration, id(optimizer)))
        kept = [(p, n) for o, p, n in self._norms.get(iteration, []) if o is optimizer]
        if kept:
            params, norms = kept[-1]
        else:
            params = [
                p for g in optimizer.param_groups for p in g["params"] if grad_for(optimizer, p) is not None
            ]
            if not params:
                return
            norms = max_norms([local_shard(grad_for(optimizer, p)) for p in params])
        self._pending.append((HostCopy(norms), optimizer, params))
        del self._pending[:-_MAX_PENDING_NAMES]

    def resolve(self) -> list[str]:
        """Take in the norms that have reached the host; return the latest names."""
        while self._pending and self._pending[0][0].ready():
            copy, optimizer, params = self._pending.pop(0)
            flags = [
                v if isinstance(v, bool) else not math.isfinite(v) for v in copy.value()
            ]  # flags or norms
            bad = [self.names.name(p, optimizer) for p, b in zip(params, flags, strict=True) if b]
            if bad:
                self.overflow_params = bad[:_MAX_NAMES]
        return list(self.overflow_params)

    # ---------------------------------------------------------------- collapse
    def on_update(self, scaler, rule_applied):
        if not rule_applied:
            self._scale_ref = None  # update(new_scale) may have set any scale
            return
        closed = scaler.iteration - 1  # the iteration this update closed
        if self._copy is not None and self._copy[0].ready():
            self._read_counters(*self._copy)
            self._copy = None
        if self._copy is None:
            copy = HostCopy(scaler.state.counters)
            if copy.ready():
                self._read_counters(copy, closed)
            else:
                self._copy = (copy, closed)
        self._named = {key for key in self._named if key[0] >= closed}
        self.resolve()
        self._watch_floor(scaler)
        self._scale_mark = _mark(scaler.state["scale"])
        limit = scaler.config.max_consecutive_skips
        if limit is not None and self.known_consecutive >= limit:
            if scaler.config.at_min_scale == "raise":
                self._raise_collapse(scaler)
            if not self.collapse_warned:  # "warn" and "clamp": say it once, keep going
                self.collapse_warned = True
                message = collapse_message(scaler, self.known_consecutive, self.resolve())
                self._emit({"event": "collapse_warning", "message": message})
                mode = scaler.config.at_min_scale
                warnings.warn(f"{message} (at_min_scale={mode!r}: training goes on)", stacklevel=4)
        elif self.known_consecutive == 0:
            self.collapse_warned = False

    def _read_counters(self, copy: HostCopy, iteration: int) -> None:
        """Take in a landed copy of the counters after `iteration`'s update; a skip there sends the
        norms `clip_grad_norm_` kept for it to the host (its names), and its skip count bounds the
        scale from below (`_floor_possible`)."""
        self.counters_seen = dict(zip(PACKED, copy.value(), strict=True))
        consecutive, skipped = self.known_consecutive, self.known_skipped
        self._skipped_reads.append((iteration, skipped))
        del self._skipped_reads[: -4 * _MAX_PENDING_NAMES]
        if consecutive > 0:
            for optimizer, _, _ in self._norms.get(iteration, []):
                self._queue(iteration, optimizer)

    def _floor_possible(self, closed: int, config: LossScaleConfig) -> bool:
        """Whether the scale may sit at `min_scale` after the update that closed iteration `closed`,
        from a lower bound the host has without a copy: the last scale it read, backed off once for
        every skip the counters have shown since, and once for every update whose counters it has
        not read yet (an update backs off at most once, and only on a skip; growth only raises the
        scale). Unknown (no scale read yet, or `update(new_scale)` / a loaded state since): possible."""
        if self._scale_ref is None:
            return True
        return self._floor_bound(closed, config) <= config.min_scale * (1 + 1e-6)  # (FP32 products)

    def _floor_bound(self, closed: int, config: LossScaleConfig) -> float:
        """A lower bound on the scale after the update that closes `closed` (see `_floor_possible`)."""
        value, skipped = self._scale_ref
        read_at, read_skipped = self._skipped_reads[-1]
        backoffs = read_skipped - skipped + max(0, closed - read_at)
        return value * config.backoff_factor**backoffs

    def _growths(self, closed: int, config: LossScaleConfig) -> int:
        """At most how many times the scale has grown from the last scale read to the update that closes
        `closed`: a growth takes `growth_interval` clean updates in a row, the first one fewer (the
        growth tracker at the read is not known), so at most one per `growth_interval` updates."""
        return -(-max(0, closed - self._ref_at) // config.growth_interval)

    def _ceiling_stale(self, closed: int, config: LossScaleConfig) -> bool:
        """Whether the next update's clamp may bind at `max_scale` only because the last scale read is
        `growth_interval` or more updates old: a new read (one copy, at most once per `growth_interval`
        updates) lets the updates after it leave the clamp out again."""
        return (
            self._scale_ref is not None
            and closed - self._ref_at >= config.growth_interval
            and self._scale_ref[0] * config.growth_factor ** self._growths(closed + 1, config)
            >= config.max_scale * (1 - 1e-3)
        )

    def clamp_may_bind(self, scaler: DynamicLossScaler, skipped: bool | None) -> bool:
        """Whether the update about to run may need its clamp into [min_scale, max_scale] (one device
        op): False only where the host shows the scale stays inside without it, from the last scale
        read: backed off at most once per skip the counters showed and per update not read yet (the
        floor's bound, `_floor_possible`), grown at most once per `growth_interval` updates
        (`_growths`). `skipped` is what the host knows of this update's step (None: nothing). Unknown
        (no scale read yet, `update(new_scale)`, a loaded state, a write to the scale from outside
        since our last update): it may."""
        if tracing_or_capturing():  # a compiled or captured update runs no host bookkeeping: it clamps
            return True
        c = scaler.config
        closed = scaler.iteration - 1  # the iteration this update closes
        if self._scale_ref is None or self._scale_mark != _mark(scaler.state["scale"]):
            return True
        if skipped is not True and self._scale_ref[0] * c.growth_factor ** self._growths(closed, c) >= (
            c.max_scale * (1 - 1e-3)  # (the device rounds each product to FP32)
        ):
            return True
        if skipped is False:  # a clean step does not lower the scale, and it is at least the floor
            return False
        return self._floor_bound(closed, c) <= c.min_scale * (1 + 1e-3)

    def _rebase(self, value: float, iteration: int) -> None:
        """A scale read on the host, after the update that closed `iteration`: the bound's new start,
        with the skips counted by the latest counters read at or before that update."""
        earlier = [skipped for at, skipped in self._skipped_reads if at <= iteration]
        if earlier:
            self._scale_ref = (value, earlier[-1])
            self._ref_at = iteration

    def _watch_floor(self, scaler: DynamicLossScaler) -> None:
        """Count updates in a row that left the scale at `min_scale`, from host copies of the scale
        (on CUDA read an update or so late, never waited for; made only while the scale may be at
        the floor, see the class); an event at `floor_event_steps`."""
        c = scaler.config
        if not c.floor_event_steps or c.mode != "dynamic":
            return
        closed = scaler.iteration - 1
        if self._floor_possible(closed, c) or self._ceiling_stale(closed, c):
            self._scale_copies.append((HostCopy(scaler.state["scale"]), closed))
        elif self._scale_copies:  # above the floor for sure: ends the run at the floor, in order
            self._scale_copies.append((None, closed))
        else:
            self.steps_at_floor = 0
        while self._scale_copies and (self._scale_copies[0][0] is None or self._scale_copies[0][0].ready()):
            copy, at = self._scale_copies.pop(0)
            if copy is None:
                self.steps_at_floor = 0
                continue
            value = copy.value()
            self._rebase(value, at)
            at_floor = value <= c.min_scale
            self.steps_at_floor = self.steps_at_floor + 1 if at_floor else 0
            if self.steps_at_floor == c.floor_event_steps:
                message = (
                    f"hf_lossscale: the loss scale has sat at its floor min_scale={c.min_scale:g} for "
                    f"{c.floor_event_steps} optimizer steps in a row: gradients below "
                    f"{2.0**-24 / c.min_scale:.1e} flush to zero in FP16. If steps keep being skipped, "
                    "an overflow no scale can fix is likely (see the overflow events' `origin`; "
                    "`fp32_modules`); otherwise consider a lower min_scale."
                )
                self._emit(
                    {"event": "floor", "steps_at_floor": self.steps_at_floor, "min_scale": c.min_scale}
                )
                warnings.warn(message, stacklevel=4)
        del self._scale_copies[:-_MAX_PENDING_NAMES]

    def _emit(self, event: dict) -> None:
        if self.sink is None:  # unpickled from a version that kept a list
            self.sink = EventSink()
        self.sink.emit(event)

    def on_state_loaded(self, scaler):
        self.counters_seen = {k: scaler.state.host[k] for k in PACKED}
        self._copy = None  # a copy in flight belongs to the state replaced
        self._scale_copies = []
        self._scale_ref = None
        self._scale_mark = None
        self._skipped_reads = [(scaler.iteration - 1, self.known_skipped)]
        self.steps_at_floor = 0
        self._named.clear()
        self._norms.clear()

    def _raise_collapse(self, scaler: DynamicLossScaler) -> None:
        origin = scaler.overflow_origin or {}
        raise LossScaleCollapseError(
            collapse_message(scaler, self.known_consecutive, self.resolve()),
            origin=origin.get("origin"),
            kind=origin.get("kind"),
            nonfinite_loss_steps=scaler.state["consecutive_nonfinite_loss"].item(),
        )


def collapse_message(scaler: DynamicLossScaler, consecutive: int, params: list[str]) -> str:
    """The collapse error's text: the diagnosed origin first, then what the counters say, then the
    parameters with non-finite gradients (detail). Reads the device (only when it fires)."""
    c = scaler.config
    nonfinite_loss = min(scaler.state["consecutive_nonfinite_loss"].item(), consecutive)
    origin = scaler.overflow_origin or {}
    name = origin.get("origin")
    where = display_origin(name)
    if origin.get("kind") == "forward" and name is not None:
        remedy = (
            f"Run it in FP32: fp32_modules=['{name}'] (--loss_scale_fp32_modules / HF_LOSSSCALE_FP32_MODULES), "
            "or 'auto'. "
            if name
            else "Compute the loss (or the head) in FP32, or run the model's last modules in FP32. "
        )
        lead = (
            f"Forward overflow in {where}: its output is non-finite in FP16 while its inputs are finite, so no "
            f"loss scale can help. {remedy}"
        )
    elif origin.get("kind") == "backward" and name is not None:
        lead = (
            f"Backward overflow starting in {where}: its input gradient is non-finite while its output "
            "gradient is finite. "
        )
    else:
        lead = ""
    names = ", ".join(params) or "not recorded"
    kinds = (
        f"{nonfinite_loss} of them with a non-finite loss (forward overflow: the scale was left alone), "
        f"{consecutive - nonfinite_loss} with non-finite gradients only"
    )
    return (
        f"{lead}Loss scale collapsed: {consecutive} optimizer steps in a row were skipped ({kinds}; "
        f"limit max_consecutive_skips={c.max_consecutive_skips}). "
        f"Scale now {scaler.state['scale'].item():g}, floor min_scale={c.min_scale:g}, "
        f"mode={c.mode!r}. Parameters with non-finite gradients: {names}. "
        + (
            ""
            if lead
            else "The loss or activations are probably non-finite already in FP32 (check the data, the "
            "learning rate), an FP16 overflow in the forward pass (the Trainer's overflow events name its "
            "origin; `hf-lossscale preflight` finds it before training), or the scale is pinned too high "
            "(static mode / min_scale)."
        )
    )


def default_observers(scaler: DynamicLossScaler) -> list[ScalerObserver]:
    """The observers a scaler starts with beside its built-in `SkipWatch`: `TelemetryWatch`; none in
    `"off"` mode."""
    if not scaler.is_enabled():
        return []
    return [TelemetryWatch()]


def _mark(scale: torch.Tensor) -> tuple[int, int, int]:
    return (id(scale), scale.data_ptr(), scale._version)
