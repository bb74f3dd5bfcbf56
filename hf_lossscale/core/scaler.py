"""`DynamicLossScaler`: a configurable, device-side drop-in for `torch.amp.GradScaler`.

Imports only torch. The state (scale, growth and hysteresis trackers, step counters) lives in
0-d tensors on the gradients' device, and `scale()`, `unscale_()` and `update()` never read it
back to the host. `step()` costs no host synchronisation with optimizers that take
`grad_scale`/`found_inf` (torch's fused Adam/AdamW/SGD) and one otherwise, as torch's does.

The scaler is the protocol (`scale`, `unscale_`, `step`, `update`, state) and composes its parts,
each a unit of its own: the state and its checkpoint format (`scaler_state.ScalerState`), the update
rule (`update_rule`: functions of the config, the state and the iteration's flags, and the
`StepOutcome` they leave in `last_step`), the iteration's flags buffer and loss probe
(`step_flags.StepFlags`), the one read of the gradients (`grad_pass`), and the observers.
"""

from __future__ import annotations

import itertools
import warnings
from collections import abc, defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch.amp.grad_scaler import OptState  # torch's stages: third-party code compares against them

from ..masters.optimizer_wrappers import inner_optimizer as _inner_optimizer
from ..masters.weights import MasterWeights, grad_for, masters_of
from . import grad_pass, scaler_clip
from . import update_rule as rule
from .config import LossScaleConfig
from .distributed import world_size
from .hostcopy import tracing_or_capturing
from .scaled_loss import with_backward_context
from .scaler_args import scaler_arguments
from .scaler_observers import (
    LossScaleCollapseError,
    ParameterNames,
    ScalerObserver,
    SkipWatch,
    default_observers,
)
from .scaler_state import STATE_FORMAT, STATE_FORMAT_VERSION, ScalerState, StepCounts
from .scaler_surface import TorchSurface
from .step_flags import StepFlags
from .telemetry import FP16_MAX, GradientTelemetry
from .update_rule import RuleConstants, StepOutcome

__all__ = ["DynamicLossScaler", "LossScaleCollapseError", "OptState", "STATE_FORMAT", "STATE_FORMAT_VERSION"]


def _fresh_optimizer_state() -> dict[str, Any]:
    """An optimizer's per-iteration record, equal to torch's `_refresh_per_optimizer_state()`."""
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _of_last_step(attr: str, doc: str) -> property:
    """A read-only property of the scaler that reads `last_step.<attr>` (the `StepOutcome`)."""
    return property(lambda self: getattr(self.last_step, attr), doc=f"`last_step.{attr}`: {doc}")


# Why a subclass of torch's GradScaler: code that takes "a GradScaler" checks it with isinstance
# (torch's optimizers that take `grad_scaler=`, type-checked training loops), and a drop-in must pass.
# Nothing of torch's implementation runs: __init__ is not called and every method torch's class
# defines is overridden here (its private ones in the block at the end of the class);
# tests/test_torch_gradscaler_contract.py holds that to the list.
class DynamicLossScaler(TorchSurface, torch.amp.GradScaler):
    """Loss scaler with a floor, a ceiling, hysteresis, static and off modes, and skip counters.

    It keeps `torch.amp.GradScaler`'s methods and call order (`scale`, `unscale_`, `step`,
    `update`, `state_dict`, ...), so it drops in wherever that one is used: plain training
    loops, Accelerate's `AcceleratedOptimizer` and `clip_grad_norm_`, and the Trainer's
    checkpointing.

    Update rule, applied once per `update()` after every optimizer of the iteration stepped:

    - overflow (inf/NaN in the gradients of any optimizer stepped since the last update; that
      optimizer's step was skipped): growth tracker = 0, hysteresis tracker -= 1 (kept at >= 0),
      and once it reaches 0 the scale becomes `max(scale * backoff_factor, min_scale)`.
    - clean step: growth tracker += 1 (with `consecutive_hysteresis` the hysteresis budget
      refills); when it reaches `growth_interval` the scale becomes
      `min(scale * growth_factor, max_scale)`, the growth tracker 0 and the budget full.

    Also takes torch's signature, positionally or by keyword: `DynamicLossScaler("cuda", 2.0**16, 2.0,
    0.5, 2000, True)` is `GradScaler`'s call, and `DynamicLossScaler("cuda", enabled=False)` too.

    Args:
        config (`LossScaleConfig`, *optional*): the configuration; defaults to `LossScaleConfig()`. A
            device string or `torch.device` here is torch's first argument, the device.
        init_scale (`float`, *optional*): torch's second argument: the config field, over `config`.
        growth_factor (`float`, *optional*): torch's third argument, likewise.
        backoff_factor (`float`, *optional*): torch's fourth argument, likewise.
        growth_interval (`int`, *optional*): torch's fifth argument, likewise.
        device (`str` or `torch.device`, *optional*):
            where the state lives. `None` takes the device of the first tensor given to `scale()`.
            A CUDA device on a machine without CUDA is an error.
        enabled (`bool`, *optional*, defaults to `True`):
            `False` is the same as `mode="off"` (kept for `GradScaler` compatibility).
        **overrides: any `LossScaleConfig` field, e.g. `init_scale=2.0**12`.

    Example:

    ```python
    >>> import torch
    >>> from hf_lossscale import DynamicLossScaler
    >>> model = torch.nn.Linear(4, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> scaler = DynamicLossScaler(init_scale=2.0**10, min_scale=1.0, hysteresis=2)
    >>> loss = model(torch.randn(8, 4)).pow(2).mean()
    >>> scaler.scale(loss).backward()
    >>> scaler.unscale_(optimizer)
    >>> _ = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    >>> scaler.step(optimizer)
    >>> scaler.update()
    >>> scaler.stats()["total_steps"]
    1
    ```
    """

    def __init__(
        self,
        config: LossScaleConfig | str | torch.device | None = None,
        init_scale: float | None = None,
        growth_factor: float | None = None,
        backoff_factor: float | None = None,
        growth_interval: int | None = None,
        enabled: bool = True,
        *,
        device: str | torch.device | None = None,
        **overrides: Any,
    ) -> None:
        torch_args = (init_scale, growth_factor, backoff_factor, growth_interval)
        self.config, self._device = scaler_arguments(config, torch_args, enabled, device, overrides)
        #: The scale, trackers and counters: host values until the first `scale()`, then device tensors.
        self.state = ScalerState(self.config)
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_fresh_optimizer_state)
        self._iteration = 0  # host-side count of update() calls: decides telemetry without a sync
        self._found_inf_group: Any = None  # set by sync_found_inf_across() for local-shard paths
        self._rule_constants: dict[torch.device, RuleConstants] = {}  # see _constants
        #: The iteration's loss probe and found-inf flag, side by side on the device (`StepFlags`).
        self.flags = StepFlags()
        #: What the last `update()` decided: skipped, backed off, loss non-finite (`StepOutcome`).
        self.last_step = StepOutcome(self.state)
        #: The latest overflow diagnosis (`hf_lossscale.core.overflow`): {"kind", "origin", "step", ...}.
        #: The collapse error leads with it. Set by whoever diagnoses (the Trainer's callback).
        self.overflow_origin: dict[str, Any] | None = None
        #: Steps taken at the floor with clamped gradients (`at_min_scale="clamp"`), host-side.
        self.clamped_steps = 0
        #: Names of parameters for overflow reports and errors (`set_parameter_names`).
        self.parameter_names = ParameterNames()
        #: FP32 master weights of the optimizers' trainable FP16 parameters (`config.master_weights`);
        #: each optimizer owns its own (`hf_lossscale.core.master_weights`).
        self.master_weights = MasterWeights(self.parameter_names.given, self.config.master_weights)
        #: Exponent histograms of the scaled gradients every `config.telemetry_interval` iterations.
        self.telemetry = GradientTelemetry(self.config.telemetry_interval)
        self._deferred_updates = 0  # updates made under torch.compile whose observers are not yet told
        #: The overflow names and the collapse check: built in, always told first, not in `observers`
        #: (so emptying that list cannot switch the collapse check off: `max_consecutive_skips=0`
        #: does). None in `"off"` mode.
        self.skip_watch: SkipWatch | None = SkipWatch(self.parameter_names) if self.is_enabled() else None
        #: Further observers the scaler tells what happened (`ScalerObserver`s; by default the
        #: telemetry); empty in `"off"` mode. Add or remove freely.
        self.observers: list[ScalerObserver] = default_observers(self)
        #: What the backward of a scaled loss runs under (`core.scaled_loss`): None, or the FP16
        #: emulation of a CPU run, which `install_loss_scaler` sets.
        self._backward_context: Any = None

    # ------------------------------------------------------------------ config access
    @property
    def mode(self) -> str:
        return self.config.mode

    def is_enabled(self) -> bool:
        """`False` in `"off"` mode: then `scale`, `unscale_` are no-ops and `step` just steps."""
        return self.config.mode != "off"

    def set_parameter_names(self, named: torch.nn.Module | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Name parameters (a module or `named_parameters()` pairs) for overflow and error reports."""
        self.parameter_names.add(named.named_parameters() if isinstance(named, torch.nn.Module) else named)

    def sync_found_inf_across(self, group: Any = None) -> None:
        """All-reduce (max) each optimizer's found-inf flag over `group` (default: the world) before
        the skip decision, so every rank skips and backs off together.

        Only for paths whose gradients are *local shards* (FSDP1's flat parameters, or your own
        sharding). Not needed with DDP (gradients are all-reduced before the check) nor FSDP2
        (torch reduces the flag for DTensor gradients). One small collective per optimizer and
        step, queued on the device: no host synchronisation. A rank holding no gradient still
        takes part (with a clean flag), so none waits forever.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "sync_found_inf_across() needs an initialised torch.distributed process group."
            )
        self._found_inf_group = group if group is not None else dist.group.WORLD

    # ------------------------------------------------------------------ state
    @property
    def device(self) -> torch.device | None:
        return self.state.device or self._device

    @property
    def iteration(self) -> int:
        """How many times `update()` has run (restored from `total_steps` on load). Host-side."""
        return self._iteration

    def _constants(self, device: torch.device) -> RuleConstants:
        """The device constants of the rule and the flags on `device`, made once (at the first step
        that needs one)."""
        found = self._rule_constants.get(device)
        if found is None:
            found = self._rule_constants[device] = RuleConstants.on(device)
        return found

    def _require_init(self, funcname: str) -> None:
        if not self.state.materialised:
            raise RuntimeError(
                f"DynamicLossScaler.{funcname}() was called before scale(): call "
                "scaler.scale(loss).backward() first in each iteration."
            )

    # ------------------------------------------------------------------ scale
    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or nested lists/tuples of tensors, by the current scale.

        No host synchronisation. In `"off"` mode the outputs come back unchanged (values; with a backward
        context, emulated CPU FP16, as `ScaledLoss`es whose backward runs under it).
        """
        first, outputs = _first_tensor_of(outputs)
        self._catch_up()
        if not self.state.materialised:
            self.state.materialise(self._device or first.device)
        context = None if tracing_or_capturing() else self._backward_context  # (a subclass does not trace)
        if not self.is_enabled() and context is None:
            return outputs
        per_device: dict[torch.device, torch.Tensor] = {}

        def apply(val: Any) -> Any:
            if isinstance(val, torch.Tensor) and not self.is_enabled():
                return with_backward_context(val, context)
            if isinstance(val, torch.Tensor):
                scale = per_device.get(val.device)
                if scale is None:
                    scale = self._scale.to(device=val.device, non_blocking=True)
                    per_device[val.device] = scale
                # the scale plus `loss * 0`: the scale itself for a finite loss, NaN for a non-finite one,
                # whose backward then poisons exactly the gradients it produces (a zero_grad() clears it
                # with them; the step that keeps them is skipped). One op; the probe is read off it.
                factor = torch.addcmul(scale, val.detach(), self._constants(val.device).zero)
                self.flags.note_loss(factor, self._scale.device)
                return with_backward_context(val * factor, context)
            if isinstance(val, (list, tuple)):
                return type(val)(apply(v) for v in val)
            if isinstance(val, abc.Iterable):
                return map(apply, val)
            raise ValueError("scale() takes a Tensor or an iterable of Tensors.")

        return apply(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and check them for inf/NaN.

        Optional: call it before clipping or inspecting gradients; `step()` calls it otherwise.
        No host synchronisation. Calling it twice for one optimizer before `update()` is an error.
        """
        if not self.is_enabled():
            return
        self._require_init("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._unscale(optimizer, state, defer=False)

    def _unscale(self, optimizer: torch.optim.Optimizer, state: dict[str, Any], defer: bool) -> None:
        """`unscale_`; `defer` (the step's own read): FP16 gradients of masters stay FP16 until the step
        casts them chunk by chunk, times the scale's reciprocal (see `_read_grads`)."""
        # one op: FP32's reciprocal is correctly rounded, so it equals torch's `.double().reciprocal()
        # .float()` bitwise (rounding a correctly rounded FP64 quotient to FP32 is innocuous)
        inv_scale = torch.reciprocal(self._scale)
        state["found_inf_per_device"] = self._read_grads(
            optimizer, inv_scale, defer=defer, unscale_pending=True
        )
        state["stage"] = OptState.UNSCALED
        if self.config.at_min_scale == "clamp":
            self._clamp_at_floor(optimizer, state)

    def _read_grads(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor | None = None,
        allow_fp16: bool = False,
        *,
        defer: bool = False,
        unscale_pending: bool = False,
    ) -> dict[torch.device, torch.Tensor]:
        """The one read of the gradients (`grad_pass`): unscale in place and fill one found-inf flag per
        device (no host sync), the masters gathered and the observers told first.

        With torch's arguments (`found_inf`, `allow_fp16`, as `GradScaler._unscale_grads_` takes them,
        for code that calls it) the flags accumulate into `found_inf` (a copy of it on other devices)
        without this iteration's loss flag, and `allow_fp16=True` unscales gradients of FP16
        parameters too; by default FP16 parameters are refused with an explanation.

        `defer` (a read by `step()` or `clip_grad_norm_`, not by a caller of `unscale_`): the FP16
        gradients of master weights whose update runs chunk by chunk are checked as they are (FP16,
        multiplied by 1) and not cast: the step casts them a chunk at a time, times `inv_scale` when
        `unscale_pending`, so no FP32 gradient exists for every parameter at once.
        """

        def flag_for(device: torch.device) -> torch.Tensor:
            if found_inf is None:
                return self.flags.new_found(device, self._scale.device)
            return found_inf if found_inf.device == device else found_inf.to(device, non_blocking=True)

        # a non-finite loss poisoned its own gradients (see `scale`): the check sees it through them
        if not allow_fp16:
            self._gather_masters(optimizer, defer)  # the observers see the gradients the optimizer steps on
        for observer in self._watchers():
            observer.before_unscale(self, optimizer)
        with torch.no_grad():
            grouped = grad_pass.group_grads(optimizer, self.parameter_names.name, allow_fp16)
        found = grad_pass.unscale_and_check_(grouped, inv_scale, flag_for)
        pending = self.master_weights.pending(optimizer) if defer else []
        if pending:
            grad_pass.check_(pending, found, flag_for, self._constants(self._scale.device).one)
            if unscale_pending:
                self.master_weights.set_factor(optimizer, inv_scale)
        if not found:  # no gradients and no loss: a clean flag on the scale's device
            home = self._scale.device if self._scale is not None else inv_scale.device
            found[home] = flag_for(home)
        if self._found_inf_group is not None:
            found = grad_pass.max_over_ranks(found, self._scale.device, self._found_inf_group)
        return found

    def _gather_masters(self, optimizer: torch.optim.Optimizer, defer: bool = False) -> None:
        """With `config.master_weights`: FP32 masters for the optimizer's trainable FP16 parameters (at
        its first step), and this iteration's FP16 gradients read into them (nothing when none);
        `defer`: left FP16 where the step casts them chunk by chunk (`MasterWeights.prepare`)."""
        if self.config.master_weights is not False:
            self.master_weights.prepare(optimizer, defer and self.config.at_min_scale != "clamp")

    def _holds_fp16(self, optimizer: torch.optim.Optimizer) -> bool:
        """The optimizer steps trainable FP16 parameters (on their masters, when configured)."""
        masters = masters_of(optimizer)
        return bool(masters and masters.pairs) or any(
            p.dtype == torch.float16 and p.requires_grad
            for g in _inner_optimizer(optimizer).param_groups
            for p in g["params"]
        )

    def _check(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """Check for inf/NaN without unscaling (fused optimizers unscale inside their kernel)."""
        self._require_init("step")
        found = self._read_grads(optimizer, self._constants(self._scale.device).one, defer=True)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found

    def _found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        flags = list(self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
        if len(flags) == 1 and flags[0].device == self._scale.device:
            return flags[0]  # the kernels only read it
        return sum(f.to(self._scale.device, non_blocking=True) for f in flags)

    # ------------------------------------------------------------------ step
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless `unscale_` was called) and step the optimizer unless its gradients hold inf/NaN.

        With an optimizer that accepts `grad_scale`/`found_inf` (torch's fused Adam, AdamW, SGD) the
        decision happens inside the kernel and this costs no host synchronisation. Otherwise it
        reads the found-inf flag once (one synchronisation, as `torch.amp.GradScaler` does).
        Returns what `optimizer.step()` returns (`None` when skipped).
        """
        closure = kwargs.get("closure", args[0] if args else None)
        if closure is not None and (self.is_enabled() or self._holds_fp16(optimizer)):
            raise RuntimeError(
                "Closure use is not currently supported when loss scaling is enabled or the model is held in "
                f"FP16: {type(_inner_optimizer(optimizer)).__name__}.step() was given a closure, which "
                "re-runs the forward and backward inside optimizer.step() (torch.optim.LBFGS does): those "
                "gradients come after the scaler's inf/NaN check and unscale (and, for a model held in FP16, "
                "outside its FP32 masters), so the step cannot be loss-scaled. Train such an optimizer with "
                "FP32 weights and no loss scaling (torch.amp.GradScaler refuses closures too)."
            )
        if not self.is_enabled():  # no scaling; a model held in FP16 still steps on its masters
            self._gather_masters(optimizer, defer=True)
            retval = optimizer.step(*args, **kwargs)
            self.master_weights.write_back(optimizer)
            return retval
        self._require_init("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.UNSCALED:  # read earlier (unscale_, a clip): weights edited since
            self.master_weights.follow_weights(optimizer)  # (otherwise the read in _step checks them),
            # and gradients put on the FP16 parameters since (a tensor of one's own, an optimizer's
            # zero_grad(set_to_none=False)), taken as they are, as an FP32 parameter's would be
            self._gather_masters(optimizer, defer=True)
        retval = self._step(optimizer, state, args, kwargs)
        if not state.get("host_skipped"):  # the FP16 weights from their FP32 masters (a skip on the device
            self.master_weights.write_back(optimizer)  # left the masters, so the weights, as they were)
        return retval

    def _step(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any], args: tuple, kwargs: dict
    ) -> Any:
        if self.config.at_min_scale == "clamp":
            return self._step_clamping(optimizer, state, args, kwargs)

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if grad_pass.takes_grad_scaler(optimizer.step):
                # torch's older contract, which it still honours: the optimizer gets the scaler and
                # does the rest itself (checks, unscaling, skipping)
                warnings.warn(
                    "DynamicLossScaler passes itself to optimizer.step(grad_scaler=...) as torch.amp.GradScaler "
                    "does; torch is dropping that contract: read `optimizer.grad_scale` and `optimizer.found_inf` "
                    "instead.",
                    FutureWarning,
                    stacklevel=2,
                )
                self._before_step(optimizer, None)
                retval = optimizer.step(*args, **{**kwargs, "grad_scaler": self})
                state["stage"] = OptState.STEPPED
                return retval
            if state["stage"] is OptState.READY:
                self._check(optimizer)
                extra = getattr(optimizer, "grad_scale", None)  # an optimizer's own divisor, kept
                grad_scale = self._scale if extra is None else self._scale * extra
            elif "grad_scale" in state:  # clip_grad_norm_ left unscale and clip to the kernel
                grad_scale = state.pop("grad_scale")
            else:  # already unscaled: the kernel must not divide again
                grad_scale = getattr(optimizer, "grad_scale", None)
            found_inf = self._found_inf(optimizer)
            if grad_pass.fused_sgd_first_step(optimizer, grad_for) and found_inf.item():
                # torch's fused SGD skips a first step with its momentum buffers left uninitialised
                # (empty_like), and the next step uses them: skip here instead. One host read per
                # step, only until the buffers exist.
                self._before_step(optimizer, True)
                state["host_skipped"] = True
                state["stage"] = OptState.STEPPED
                return None
            self._before_step(optimizer, None)  # the kernel decides on the device
            optimizer.grad_scale = grad_scale
            optimizer.found_inf = found_inf
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale
                del optimizer.found_inf
            state["stage"] = OptState.STEPPED
            return retval

        if state["stage"] is OptState.READY:
            self._unscale(optimizer, state, defer=True)
        retval = None
        skipped = bool(self._found_inf(optimizer).item())  # the one host sync of the non-fused path
        self._before_step(optimizer, skipped)
        if not skipped:
            retval = optimizer.step(*args, **kwargs)
        state["host_skipped"] = skipped
        state["stage"] = OptState.STEPPED
        return retval

    def _step_clamping(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any], args: tuple, kwargs: dict
    ) -> Any:
        """`at_min_scale="clamp"`: `unscale_` decided (`_clamp_at_floor`); step unless still skipped."""
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        skipped = state["clamp_skipped"]
        self._before_step(optimizer, skipped)
        retval = None if skipped else optimizer.step(*args, **kwargs)
        state["host_skipped"] = skipped
        state["stage"] = OptState.STEPPED
        return retval

    def _clamp_at_floor(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """`at_min_scale="clamp"`, right after unscaling (so a clip the caller runs next sees the
        clamped values): with the scale at its floor after `max_consecutive_skips` skips in a row, an
        overflowing step is not skipped: NaN gradient elements become 0 and +-inf become +-65504 /
        scale (the largest FP16 gradient). Never when the loss itself was non-finite (its gradients
        are all NaN: there is nothing to keep). One host read per step (flag, scale, streak, loss)."""
        found = self._found_inf(optimizer)
        probe = self.flags.probe if self.flags.probe is not None else torch.zeros((), device=found.device)
        read = torch.stack([
            found.double(), self._scale.to(found.device).double(),
            self.state["consecutive_skips"].to(found.device).double(), probe.to(found.device).double(),
        ]).tolist()  # fmt: skip
        found_v, scale_v, streak, probe_v = read
        skipped = found_v > 0
        threshold = self.config.max_consecutive_skips or 0
        if skipped and probe_v == 0 and scale_v <= self.config.min_scale and streak >= threshold:
            grad_pass.clamp_nonfinite_(optimizer, FP16_MAX / scale_v)
            state["found_inf_per_device"] = {
                device: torch.zeros_like(flag) for device, flag in state["found_inf_per_device"].items()
            }
            self.clamped_steps += 1
            skipped = False
        state["clamp_skipped"] = skipped

    def clip_grad_norm_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
        *,
        parameters: Iterable[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Unscale, check and clip one optimizer's gradients in one read of them; return the total
        norm of the *unscaled* gradients (a device tensor, no host synchronisation).

        The result of `scaler.unscale_(optimizer)` followed by `torch.nn.utils.clip_grad_norm_` over
        the optimizer's parameters (bitwise for a power-of-two scale, see the README), for less traffic:

        - one read of the gradients gives both the norm (of the scaled gradients, divided by the
          scale) and the overflow flag (a norm is inf/NaN exactly when some gradient is);
        - with an optimizer that takes `grad_scale`/`found_inf` (torch's fused Adam/AdamW/SGD)
          nothing is written: `step()` hands the kernel `scale / clip_coefficient` as its divisor.
          The gradients in memory stay scaled until the kernel reads them;
        - otherwise one `_foreach_mul_` by `clip_coefficient / scale`.

        A non-finite norm leaves the gradients' values as they are (scaled) and `step()` skips, as
        always. `error_if_nonfinite=True` reads the norm on the host, as torch's does. Norm types
        other than 2 and inf, sparse gradients, local-shard paths (`sync_found_inf_across()`) and
        a second call take the plain path: `unscale_()` and `torch.nn.utils.clip_grad_norm_`.
        DTensor gradients (FSDP2) get the global norm. In `"off"` mode this is torch's function.

        `parameters` (optional) orders the per-tensor norms before they are summed, so that
        `parameters=model.parameters()` gives `torch.nn.utils.clip_grad_norm_(model.parameters())`'s
        norm bitwise; those with gradients must be exactly the optimizer's parameters with gradients.
        """
        return scaler_clip.clip_grad_norm(
            self, optimizer, max_norm, norm_type, error_if_nonfinite, foreach, parameters=parameters
        )

    # ------------------------------------------------------------------ update
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Apply the update rule once for this iteration (no host synchronisation).

        Call it after `step()` for every optimizer of the iteration. `new_scale` sets the scale by
        hand instead (counters are not touched).

        Raises:
            LossScaleCollapseError: after `max_consecutive_skips` skipped steps in a row. On the CPU
                it fires at the update that reaches the limit; on CUDA it reads a non-blocking copy
                of the counter, so it fires at that update or up to one update later.
        """
        if not self.state.materialised:
            if not self.is_enabled():
                return
            self._require_init("update")
        self._iteration += 1
        probe = self.flags.new_iteration()  # the probe belongs to this iteration
        last, c = self.last_step, self.config
        if new_scale is not None:
            self.state.set_scale(new_scale)
            self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
            last.skipped_if_known = None
            self._notify_update(rule_applied=False)
            return
        if not self.is_enabled():
            self.state["total_steps"].add_(1)
            last.skipped_if_known = False
            self._notify_update(rule_applied=False)
            return
        known = [state.get("host_skipped") for state in self._per_optimizer_states.values()]
        last.skipped_if_known = any(known) if known and None not in known else None
        flags = [
            f.to(self._scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for f in state["found_inf_per_device"].values()
        ]
        if not flags:
            raise RuntimeError(
                "update() found no inf checks since the last update(): call step(optimizer) for "
                "each optimizer of the iteration before update()."
            )
        found_f = torch.stack(flags).amax() if len(flags) > 1 else flags[0]
        distributed = world_size(self._found_inf_group) > 1
        fast_rule = c.mode != "dynamic" or rule.torch_rule_applies(c)  # else the general one
        host_known = last.skipped_if_known is not None and fast_rule
        k = self._constants(found_f.device)
        bind = self.skip_watch is None or self.skip_watch.clamp_may_bind(self, last.skipped_if_known)
        if host_known and not distributed and c.at_min_scale != "clamp":
            # The host read the flags (the non-fused path does). A clean step, and so a finite loss
            # (the loss probe joined every check): the rule's clean branch from constants, no flags.
            # A skipped one: the skip branch, whose only device input is whether the loss was finite.
            result = rule.apply_known_rule(c, self.state, k, last.skipped_if_known, probe, bind)
        elif probe is not None and not distributed:
            # [skipped, loss non-finite, True]: the probe is 0 or NaN, and NaN != 0. A non-finite loss
            # counts where its poisoned gradients made the step skip (zero_grad() may have dropped them):
            # two ops where the flag and the probe sit in the flags buffer (the usual case), else three
            buffer, found_view, probe_view = self.flags.views(found_f.device)
            if found_f is found_view and probe is probe_view:
                bits = buffer.ne(0)
            else:
                bits = torch.stack([found_f, probe.to(found_f.dtype), k.one]).ne(0)
            torch.logical_and(bits[1], bits[0], out=bits[1])
            result = rule.apply_rule(c, self.state, k, bits[0], bits[1], bits, bind)
        else:
            loss_bad = None if probe is None else probe.ne(0) & (found_f > 0)
            if distributed:
                loss_bad = rule.all_ranks_loss_flag(loss_bad, self._scale.device, self._found_inf_group)
            result = rule.apply_rule(c, self.state, k, found_f > 0, loss_bad, clamp=bind)
        last.record(result)
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
        self._notify_update(rule_applied=True)

    # ------------------------------------------------------------------ observers
    def _watchers(self) -> list[ScalerObserver]:
        """The built-in skip watch, then `observers`."""
        return self.observers if self.skip_watch is None else [self.skip_watch, *self.observers]

    def _before_step(self, optimizer: torch.optim.Optimizer, skipped: bool | None) -> None:
        for observer in self._watchers():
            observer.before_step(self, optimizer, skipped)

    def _notify_update(self, rule_applied: bool) -> None:
        if tracing_or_capturing():
            # The observers' host work (host copies read back, the collapse check, warnings) cannot be
            # traced, nor captured in a CUDA graph: it runs at the scaler's next eager call, once per
            # update (a count, not a list: an int that changes is traced as a dynamic value, no
            # recompile). A replayed graph runs no Python: its updates move the device state only.
            self._deferred_updates += 1
            return
        self._catch_up()
        for observer in self._watchers():
            observer.on_update(self, rule_applied)

    def _catch_up(self) -> None:
        """Run the observers' work for updates made inside a compiled region (see `_notify_update`)."""
        if tracing_or_capturing() or not self._deferred_updates:
            return
        pending, self._deferred_updates = self._deferred_updates, 0
        for _ in range(pending):
            for observer in self._watchers():
                observer.on_update(self, True)

    def drain_events(self) -> list[dict[str, Any]]:
        """Events the observers queued since the last call (`floor`, `collapse_warning`), for an event
        log; each without `step` (the caller knows it)."""
        self._catch_up()
        return [e for o in self._watchers() for e in o.drain_events()]

    @property
    def overflow_params(self) -> list[str]:
        """Names of the parameters whose gradients were non-finite at the last named skipped step.

        Named without a host sync, from copies read once they reach the host: every skip on the
        non-fused path and under `clip_grad_norm_`, and the skips after the first of a run
        otherwise (fused optimizers decide inside their kernel). On CUDA a name shows up an
        update or two after its step.
        """
        self._catch_up()
        return self.skip_watch.resolve() if self.skip_watch is not None else []

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 in `"off"` mode). Synchronises with the device."""
        if not self.is_enabled():
            return 1.0
        return self.state.value("scale")

    # ------------------------------------------------------------------ the last step (`last_step`)
    last_backed_off = _of_last_step(
        "backed_off", "did the last update back the scale off? A 0-d bool device flag, no sync."
    )
    step_skipped_tensor = _of_last_step(
        "skipped_tensor", "was the last iteration's step skipped? A 0-d bool device flag, no sync."
    )
    last_step_skipped_if_known = _of_last_step(
        "skipped_if_known", "the last skip where the host knows it, else `None`. No sync."
    )
    last_step_skipped = _of_last_step(
        "skipped", "whether the last iteration's step was skipped. Synchronises with the device."
    )
    last_loss_nonfinite = _of_last_step(
        "loss_nonfinite", "was a loss of the last iteration non-finite? A device flag, no sync."
    )

    @property
    def loss_finite_tensor(self) -> torch.Tensor | None:
        """A 0-d bool device flag: were all losses `scale()` saw since the last `update()` finite?
        None before the first `scale()` of the iteration. No sync (one device op when asked)."""
        return self.flags.loss_finite()

    def stats(self) -> dict[str, Any]:
        """Scale and counters as Python numbers. Synchronises with the device: call at log steps."""
        self._catch_up()
        return self.state.stats(self.is_enabled())

    def counts(self) -> StepCounts:
        """The step counters (`StepCounts`: total, skipped, non-finite-loss steps, the two streaks, and
        `applied_steps`), the one record of them: read them here rather than counting steps apart. One
        transfer of the counters from the device (a sync): call at log steps."""
        self._catch_up()
        return self.state.counts()

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the exact trajectory, as plain Python values.

        A superset of `torch.amp.GradScaler.state_dict()` (so torch's scaler can load it too), with
        the hysteresis tracker, the counters and the scaler's config (`LossScaleConfig.scaler_dict()`:
        not the model's FP16 handling, `config.fp16`). Loads with `torch.load(...,
        weights_only=True)` and moves between devices. Synchronises with the device.
        """
        return self.state.state_dict(self.config)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state written by `state_dict()` or by `torch.amp.GradScaler.state_dict()`.

        The current config stays in force; fields where the checkpoint's config differs are named in
        a warning (the model's FP16 handling, `config.fp16`, is not compared), and a restored scale outside `[min_scale, max_scale]` is clamped with a warning.
        A malformed state raises `ValueError` naming the missing or wrong keys.
        """
        self.config = self.state.load_state_dict(state_dict, self.config)
        rule.clamp_growth_tracker(self.config, self.state)
        self._iteration = self.state.host["total_steps"]  # telemetry keeps its cadence across a resume
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
        for observer in self._watchers():
            observer.on_state_loaded(self)

    def __getstate__(self) -> dict[str, Any]:
        if self.is_enabled() and self._per_optimizer_states:
            raise RuntimeError(
                "A DynamicLossScaler can be pickled only between iterations (before scale() or after update()), "
                "as torch.amp.GradScaler."
            )
        state = self.__dict__.copy()
        state["_rule_constants"] = {}  # device constants, made again on first use (so are the flags')
        state.pop("master_weights", None)  # the masters belong to the optimizers
        state.pop("_backward_context", None)  # the install's, on its accelerator
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a scaler pickled by an earlier version: its flags and last step were attributes of its own
        old = {
            k: state.pop(k, None)
            for k in ("_loss_probe", "_host_skipped", "_backed_off", "last_loss_nonfinite")
        }
        for name in ("_flags", "_found_taken", "_grad_sentinel"):
            state.pop(name, None)
        self.__dict__.update(state)
        self.__dict__.setdefault("_rule_constants", {})
        self.__dict__.setdefault("_backward_context", None)
        if "flags" not in state:
            self.flags = StepFlags()
            self.flags.probe = old["_loss_probe"]
            self.last_step = StepOutcome(self.state)
            self.last_step.record(rule.RuleResult(old["last_loss_nonfinite"], old["_backed_off"]))
            self.last_step.skipped_if_known = old["_host_skipped"]
        self.master_weights = MasterWeights(self.parameter_names.given, self.config.master_weights)

    def __repr__(self) -> str:
        return f"DynamicLossScaler({self.config!r}, device={self.device})"


def _first_tensor_of(outputs: Any) -> tuple[torch.Tensor, Any]:
    """scale()'s outputs: their first tensor, and the outputs (a generator peeked at, given back whole)."""
    kind = type(outputs).__name__
    if isinstance(outputs, abc.Iterator):  # a generator (torch's scaler takes any iterable): peek
        head = next(outputs, None)
        first = _first_tensor_nested(head)
        outputs = itertools.chain([head], outputs)
    else:
        first = _first_tensor_nested(outputs)
    if first is None:
        raise ValueError(
            f"scale() takes a Tensor, or a list, tuple or other iterable of Tensors; got {kind} without a Tensor."
        )
    return first, outputs


def _first_tensor_nested(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for v in value:
            t = _first_tensor_nested(v)
            if t is not None:
                return t
    return None
