"""`DynamicLossScaler`: a configurable, device-side drop-in for `torch.amp.GradScaler`.

Imports only torch. The state (scale, growth and hysteresis trackers, step counters) lives in
0-d tensors on the gradients' device, and `scale()`, `unscale_()` and `update()` never read it
back to the host. `step()` costs no host synchronisation with optimizers that take
`grad_scale`/`found_inf` (torch's fused Adam/AdamW/SGD) and one otherwise, as torch's does.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections import abc, defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch.amp.grad_scaler import OptState  # torch's stages: third-party code compares against them

from .clip import total_norm
from .config import SCALE_MAX, SCALE_MIN, LossScaleConfig
from .master_weights import MasterWeights
from .scaler_observers import (
    LossScaleCollapseError,
    ParameterNames,
    ScalerObserver,
    SkipWatch,
    default_observers,
)
from .scaler_state import STATE_FORMAT, STATE_FORMAT_VERSION, ScalerState
from .step_flags import StepFlags
from .telemetry import FP16_MAX, GradientTelemetry
from .torch_surface import TorchGradScalerSurface, fused_sgd_first_step, mul_grads_, takes_grad_scaler
from .update_rule import RuleConstants, UpdateRule, world_size

__all__ = ["DynamicLossScaler", "LossScaleCollapseError", "OptState", "STATE_FORMAT", "STATE_FORMAT_VERSION"]


def _fresh_optimizer_state() -> dict[str, Any]:
    """An optimizer's per-iteration record, equal to torch's `_refresh_per_optimizer_state()`."""
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _tracing_or_capturing() -> bool:
    """Inside torch.compile's tracing, or a CUDA graph capture: no host work may run."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# Why a subclass of torch's GradScaler: code that takes "a GradScaler" checks it with isinstance
# (torch's optimizers that take `grad_scaler=`, type-checked training loops), and a drop-in must pass.
# Nothing of torch's implementation runs: __init__ is not called and every method torch's class
# defines is overridden, here or in the mixins (update_rule, step_flags, torch_surface);
# tests/test_torch_gradscaler_contract.py holds that to the list.
class DynamicLossScaler(TorchGradScalerSurface, StepFlags, UpdateRule, torch.amp.GradScaler):
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
        if isinstance(config, (str, torch.device)):  # torch's signature: GradScaler(device, init_scale, ...)
            if device is not None:
                raise TypeError(f"DynamicLossScaler got the device twice: {config!r} and device={device!r}.")
            config, device = None, config
        torch_args = {
            name: value
            for name, value in (
                ("init_scale", init_scale),
                ("growth_factor", growth_factor),
                ("backoff_factor", backoff_factor),
                ("growth_interval", growth_interval),
            )
            if value is not None
        }
        twice = sorted(set(torch_args) & set(overrides))
        if twice:
            raise TypeError(f"DynamicLossScaler got {twice} twice.")
        overrides = {**torch_args, **overrides}
        if config is None:
            config = LossScaleConfig(**_torch_ceiling(_check_overrides(overrides)))
        elif not isinstance(config, LossScaleConfig):
            raise TypeError(f"config must be a LossScaleConfig, got {type(config).__name__}.")
        elif overrides:
            config = config.replace(**_check_overrides(overrides))
        if not enabled:
            config = config.replace(mode="off")
        self.config = config
        if device is not None and enabled:
            device = _check_device(device)
        self._device = torch.device(device) if device is not None else None
        #: The scale, trackers and counters: host values until the first `scale()`, then device tensors.
        self.state = ScalerState(config)
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_fresh_optimizer_state)
        self._host_skipped: bool | None = None  # the last step's skip, where the host already knows it
        self._iteration = 0  # host-side count of update() calls: decides telemetry without a sync
        self._found_inf_group: Any = None  # set by sync_found_inf_across() for local-shard paths
        # 0-d device tensor: the sum of `loss * 0` over the losses scale() saw since the last update():
        # 0 when all were finite, NaN otherwise (inf * 0 is NaN); None when none was seen. The overflow
        # check reads it together with the gradients, in the same kernel call.
        self._loss_probe: torch.Tensor | None = None
        self._rule_constants: dict[torch.device, RuleConstants] = {}  # see _constants
        self._flags: dict[torch.device, tuple[torch.Tensor, ...]] = {}  # see _flag_views
        self._found_taken = False  # whether this iteration's check used the flags buffer (_new_found)
        #: Device flags of the last update: its loss was non-finite / it backed the scale off.
        self.last_loss_nonfinite: torch.Tensor | None = None
        # the last update's backoff: a bool flag, or (fast rule) its float overflow flag, compared on request
        self._backed_off: torch.Tensor | None = None
        #: The latest overflow diagnosis (`hf_lossscale.core.overflow`): {"kind", "origin", "step", ...}.
        #: The collapse error leads with it. Set by whoever diagnoses (the Trainer's callback).
        self.overflow_origin: dict[str, Any] | None = None
        #: Steps taken at the floor with clamped gradients (`at_min_scale="clamp"`), host-side.
        self.clamped_steps = 0
        #: Names of parameters for overflow reports and errors (`set_parameter_names`).
        self.parameter_names = ParameterNames()
        #: FP32 master weights of the optimizers' trainable FP16 parameters (`config.master_weights`);
        #: each optimizer owns its own (`hf_lossscale.core.master_weights`).
        self.master_weights = MasterWeights(self.parameter_names.given)
        #: Exponent histograms of the scaled gradients every `config.telemetry_interval` iterations.
        self.telemetry = GradientTelemetry(config.telemetry_interval)
        self._deferred_updates = 0  # updates made under torch.compile whose observers are not yet told
        #: The overflow names and the collapse check: built in, always told first, not in `observers`
        #: (so emptying that list cannot switch the collapse check off: `max_consecutive_skips=0`
        #: does). None in `"off"` mode.
        self.skip_watch: SkipWatch | None = SkipWatch(self.parameter_names) if self.is_enabled() else None
        #: Further observers the scaler tells what happened (`ScalerObserver`s; by default the
        #: telemetry); empty in `"off"` mode. Add or remove freely.
        self.observers: list[ScalerObserver] = default_observers(self)

    # ------------------------------------------------------------------ config access
    @property
    def mode(self) -> str:
        return self.config.mode

    def is_enabled(self) -> bool:
        """`False` in `"off"` mode: then `scale`, `unscale_` are no-ops and `step` just steps."""
        return self.config.mode != "off"

    def get_growth_factor(self) -> float:
        return self.config.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self.config = self.config.replace(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        return self.config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self.config = self.config.replace(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        return self.config.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self.config = self.config.replace(growth_interval=new_interval)
        self._clamp_growth_tracker()

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

    def _require_init(self, funcname: str) -> None:
        if not self.state.materialised:
            raise RuntimeError(
                f"DynamicLossScaler.{funcname}() was called before scale(): call "
                "scaler.scale(loss).backward() first in each iteration."
            )

    # ------------------------------------------------------------------ scale
    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or nested lists/tuples of tensors, by the current scale.

        No host synchronisation. In `"off"` mode the outputs come back unchanged.
        """
        kind = type(outputs).__name__
        if isinstance(outputs, abc.Iterator):  # a generator (torch's scaler takes any iterable): peek
            head = next(outputs, None)
            first = _first_tensor_nested(head)
            outputs = itertools.chain([head], outputs)
        else:
            first = _first_tensor_nested(outputs)
        if first is None:
            raise ValueError(
                f"scale() takes a Tensor, or a list, tuple or other iterable of Tensors; got {kind} "
                "without a Tensor."
            )
        self._catch_up()
        if not self.state.materialised:
            self.state.materialise(self._device or first.device)
        if not self.is_enabled():
            return outputs
        per_device: dict[torch.device, torch.Tensor] = {}

        def apply(val: Any) -> Any:
            if isinstance(val, torch.Tensor):
                scale = per_device.get(val.device)
                if scale is None:
                    scale = self._scale.to(device=val.device, non_blocking=True)
                    per_device[val.device] = scale
                # the scale plus `loss * 0`: the scale itself for a finite loss, NaN for a non-finite one,
                # whose backward then poisons exactly the gradients it produces (a zero_grad() clears it
                # with them; the step that keeps them is skipped). One op; the probe is read off it.
                factor = torch.addcmul(scale, val.detach(), self._constants(val.device).zero)
                self._note_loss(factor)
                return val * factor
            if isinstance(val, (list, tuple)):
                return type(val)(apply(v) for v in val)
            if isinstance(val, abc.Iterable):
                return map(apply, val)
            raise ValueError("scale() takes a Tensor or an iterable of Tensors.")

        return apply(outputs)

    @property
    def last_backed_off(self) -> torch.Tensor | None:
        """A 0-d bool device flag: did the last update decide to back the scale off (an overflow
        counted against it, the hysteresis budget spent)? No sync. At the floor the clamp can leave
        the value where it was: whether it moved is `get_scale()` against the scale the step ran at
        (telling the two apart here would cost one more device op in every update)."""
        if self._backed_off is not None and self._backed_off.dtype != torch.bool:
            self._backed_off = self._backed_off > 0  # one op, only when someone asks
        return self._backed_off

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
        # one op: FP32's reciprocal is correctly rounded, so it equals torch's `.double().reciprocal()
        # .float()` bitwise (rounding a correctly rounded FP64 quotient to FP32 is innocuous)
        inv_scale = torch.reciprocal(self._scale)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale)
        state["stage"] = OptState.UNSCALED
        if self.config.at_min_scale == "clamp":
            self._clamp_at_floor(optimizer, state)

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
        if not self.is_enabled():  # no scaling; a model held in FP16 still steps on its masters
            self._gather_masters(optimizer)
            retval = optimizer.step(*args, **kwargs)
            self.master_weights.write_back(optimizer)
            return retval
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not supported when loss scaling is enabled.")
        self._require_init("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.UNSCALED:  # read earlier (unscale_, a clip): weights edited since
            self.master_weights.follow_weights(optimizer)  # (otherwise the read in _step checks them)
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
            if takes_grad_scaler(optimizer.step):
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
                self._check_inf_per_device(optimizer)
                extra = getattr(optimizer, "grad_scale", None)  # an optimizer's own divisor, kept
                grad_scale = self._scale if extra is None else self._scale * extra
            elif "grad_scale" in state:  # clip_grad_norm_ left unscale and clip to the kernel
                grad_scale = state.pop("grad_scale")
            else:  # already unscaled: the kernel must not divide again
                grad_scale = getattr(optimizer, "grad_scale", None)
            found_inf = self._found_inf(optimizer)
            if fused_sgd_first_step(optimizer) and found_inf.item():
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
            self.unscale_(optimizer)
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
        probe = self._loss_probe if self._loss_probe is not None else torch.zeros((), device=found.device)
        read = torch.stack([
            found.double(), self._scale.to(found.device).double(),
            self.state["consecutive_skips"].to(found.device).double(), probe.to(found.device).double(),
        ]).tolist()  # fmt: skip
        found_v, scale_v, streak, probe_v = read
        skipped = found_v > 0
        threshold = self.config.max_consecutive_skips or 0
        if skipped and probe_v == 0 and scale_v <= self.config.min_scale and streak >= threshold:
            limit = FP16_MAX / scale_v
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        if param.grad is not None:
                            values = param.grad._values() if param.grad.is_sparse else param.grad
                            torch.nan_to_num_(values, nan=0.0, posinf=limit, neginf=-limit)
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
        if self.state.materialised or not self.is_enabled():
            self._gather_masters(optimizer)  # a model held in FP16: its gradients into the FP32 masters
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if parameters is not None:  # the model's FP16 parameters: their masters
            parameters = [self.master_weights.master_of(optimizer, p) for p in parameters]
            given = {id(p) for p in parameters if p.grad is not None}
            if given != {id(p) for p in params if p.grad is not None}:
                raise ValueError(
                    "clip_grad_norm_(parameters=...): the parameters with gradients must be exactly the "
                    "optimizer's parameters with gradients (it clips what this optimizer steps)."
                )
            params = parameters
        if not self.is_enabled():
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        self._require_init("clip_grad_norm_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("clip_grad_norm_() is being called after step().")
        norm_type = float(norm_type)
        with_grad = [p for p in params if p.grad is not None]
        if (
            state["stage"] is OptState.UNSCALED
            or self.config.at_min_scale == "clamp"  # unscale_ clamps first: the clip sees the clamped values
            or norm_type not in (2.0, math.inf)
            or self._found_inf_group is not None
            or any(p.grad.is_sparse for p in with_grad)
        ):
            if state["stage"] is OptState.READY:
                self.unscale_(optimizer)
            else:
                self._apply_deferred_unscale(optimizer, state)
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)

        grouped = self._grads_by_device_and_dtype(optimizer)  # refuses FP16 parameters
        for observer in self._watchers():  # the scaled gradients, as unscale_ shows them
            observer.before_unscale(self, optimizer)
        with torch.no_grad():
            scaled_norm, per_tensor = total_norm([p.grad for p in with_grad], norm_type, foreach)
            device = scaled_norm.device if with_grad else self._scale.device
            scale = self._scale.to(device, non_blocking=True)
            norm = scaled_norm.to(device) / scale  # exact for a power-of-two scale
            # the norm is inf/NaN exactly when a gradient is (a non-finite loss poisoned its own); one
            # kernel checks it (multiplying it by 1 in place leaves its value as it is)
            found = self._new_found(device)
            torch._amp_foreach_non_finite_check_and_unscale_([norm], found, self._one(device))
            if error_if_nonfinite and found:
                raise RuntimeError(
                    f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                    "so it cannot be clipped. To disable this error and scale the gradients by the "
                    "non-finite norm anyway, set `error_if_nonfinite=False`"
                )
            coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)  # torch's formula
            # On an overflow (a non-finite norm) the step is skipped and the gradients keep their values
            # (scaled). (at_min_scale="clamp" took the plain path above.)
            if getattr(optimizer, "_step_supports_amp_scaling", False):
                # nothing is written: the kernel skips on the flag, whatever the divisor (a caller who
                # reads the gradients before step() gets them unscaled and clipped: see
                # _apply_deferred_unscale; on an overflow then, unscaled only)
                state["grad_scale"] = scale / coef
            else:
                multiplier = coef / scale  # exact: a power-of-two scale divides without rounding
                mul_grads_(grouped, torch.where(found > 0, self._one(device), multiplier), foreach)
        if per_tensor is not None and not _tracing_or_capturing():  # kept tensors mean nothing in a graph
            for observer in self._watchers():  # a norm is non-finite exactly when its gradient is
                observer.on_norms(self, optimizer, with_grad, per_tensor)
        state["found_inf_per_device"] = {device: found}
        state["stage"] = OptState.UNSCALED
        return norm

    def _apply_deferred_unscale(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Divide by the divisor `clip_grad_norm_` left for a fused kernel, now (one write pass):
        for a caller that reads or clips the gradients again before `step()`."""
        grad_scale = state.pop("grad_scale", None)
        if grad_scale is not None:
            with torch.no_grad():
                # an overflowing step's gradients are unscaled, not clipped (its divisor is inf or NaN)
                found = self._found_inf(optimizer)
                grad_scale = torch.where(found > 0, self._scale.to(grad_scale.device), grad_scale)
                mul_grads_(
                    self._grads_by_device_and_dtype(optimizer), grad_scale.double().reciprocal().float(), None
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
        probe, self._loss_probe = self._loss_probe, None  # the probe belongs to this iteration
        self._found_taken = False
        if new_scale is not None:
            self._set_scale(new_scale)
            self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
            self._host_skipped = None
            self._notify_update(rule_applied=False)
            return
        if not self.is_enabled():
            self.state["total_steps"].add_(1)
            self._host_skipped = False
            self._notify_update(rule_applied=False)
            return
        known = [state.get("host_skipped") for state in self._per_optimizer_states.values()]
        self._host_skipped = any(known) if known and None not in known else None
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
        fast_rule = self.config.mode != "dynamic" or self._torch_rule_applies()  # else the general one
        host_known = self._host_skipped is not None and fast_rule
        if host_known and not distributed and self.config.at_min_scale != "clamp":
            # The host read the flags (the non-fused path does). A clean step, and so a finite loss
            # (the loss probe joined every check): the rule's clean branch from constants, no flags.
            # A skipped one: the skip branch, whose only device input is whether the loss was finite.
            self._apply_known_rule(found_f.device, self._host_skipped, probe)
        elif probe is not None and not distributed:
            # [skipped, loss non-finite, True]: the probe is 0 or NaN, and NaN != 0. A non-finite loss
            # counts where its poisoned gradients made the step skip (zero_grad() may have dropped them):
            # two ops where the flag and the probe sit in the flags buffer (the usual case), else three
            buffer, found_view, probe_view = self._flag_views(found_f.device)
            if found_f is found_view and probe is probe_view:
                bits = buffer.ne(0)
            else:
                bits = torch.stack([found_f, probe.to(found_f.dtype), self._one(found_f.device)]).ne(0)
            torch.logical_and(bits[1], bits[0], out=bits[1])
            self._apply_rule(bits[0], bits[1], bits)
        else:
            loss_bad = None if probe is None else probe.ne(0) & (found_f > 0)
            if distributed:
                loss_bad = self._all_ranks_loss_flag(loss_bad)
            self._apply_rule(found_f > 0, loss_bad)
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
        self._notify_update(rule_applied=True)

    def _set_scale(self, new_scale: float | torch.Tensor) -> None:
        if isinstance(new_scale, torch.Tensor):
            if new_scale.numel() != 1 or new_scale.requires_grad:
                raise ValueError("new_scale must be a float or a 1-element tensor without grad.")
            self._scale.copy_(new_scale.reshape(()))
        else:
            value = float(new_scale)
            if not (SCALE_MIN <= value <= SCALE_MAX):
                raise ValueError(
                    f"update(new_scale={new_scale!r}): need a number in FP32's normal range [2**-126, FP32 max], "
                    "where the scale and its reciprocal are finite."
                )
            self._scale.fill_(value)

    # ------------------------------------------------------------------ observers
    def _watchers(self) -> list[ScalerObserver]:
        """The built-in skip watch, then `observers`."""
        return self.observers if self.skip_watch is None else [self.skip_watch, *self.observers]

    def _before_step(self, optimizer: torch.optim.Optimizer, skipped: bool | None) -> None:
        for observer in self._watchers():
            observer.before_step(self, optimizer, skipped)

    def _notify_update(self, rule_applied: bool) -> None:
        if _tracing_or_capturing():
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
        if _tracing_or_capturing() or not self._deferred_updates:
            return
        pending, self._deferred_updates = self._deferred_updates, 0
        for _ in range(pending):
            for observer in self._watchers():
                observer.on_update(self, True)

    def drain_events(self) -> list[dict[str, Any]]:
        """Events the observers queued since the last call (`floor`, `collapse_warning`), for an event
        log; each without `step` (the caller knows it)."""
        self._catch_up()
        return [e for o in self._watchers() if hasattr(o, "drain_events") for e in o.drain_events()]

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
        return self.state.host["scale"] if self._scale is None else self._scale.item()

    @property
    def step_skipped_tensor(self) -> torch.Tensor | None:
        """A 0-d bool tensor on the device: was the last iteration's step skipped? No sync.

        Each `update()` makes a new tensor, so a reference kept by the caller stays that step's flag.
        """
        return self.state["last_step_skipped"] if self.state.materialised else None

    @property
    def last_step_skipped_if_known(self) -> bool | None:
        """Whether the last iteration's step was skipped, when the host knows it without asking the
        device (every optimizer of the iteration stepped on the non-fused path, which read the flag
        in `step()`); `None` when a fused kernel decided. Never synchronises."""
        return self._host_skipped

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last iteration's step was skipped. Synchronises with the device."""
        if not self.state.materialised:
            return self.state.host["last_step_skipped"]
        return bool(self.state["last_step_skipped"].item())

    def stats(self) -> dict[str, Any]:
        """Scale and counters as Python numbers. Synchronises with the device: call at log steps."""
        self._catch_up()
        v = self.state.host_values()
        return {
            "loss_scale": v["scale"] if self.is_enabled() else 1.0,
            "total_steps": v["total_steps"],
            "skipped_steps": v["skipped_steps"],
            "consecutive_skips": v["consecutive_skips"],
            "growth_tracker": v["_growth_tracker"],
            "hysteresis_tracker": v["_hysteresis_tracker"],
            "last_step_skipped": v["last_step_skipped"],
            "nonfinite_loss_steps": v["nonfinite_loss_steps"],
            "consecutive_nonfinite_loss": v["consecutive_nonfinite_loss"],
        }

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the exact trajectory, as plain Python values.

        A superset of `torch.amp.GradScaler.state_dict()` (so torch's scaler can load it too), with
        the hysteresis tracker, the counters and the config. Loads with `torch.load(...,
        weights_only=True)` and moves between devices. Synchronises with the device.
        """
        return self.state.state_dict(self.config)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state written by `state_dict()` or by `torch.amp.GradScaler.state_dict()`.

        The current config stays in force; fields where the checkpoint's config differs are named in
        a warning, and a restored scale outside `[min_scale, max_scale]` is clamped with a warning.
        A malformed state raises `ValueError` naming the missing or wrong keys.
        """
        self.config = self.state.load_state_dict(state_dict, self.config)
        self._clamp_growth_tracker()
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
        # Device caches made again on first use: pickled, the flags buffer's views would come back as
        # copies of their own (an optimizer's overflow written where update() no longer reads it).
        state["_rule_constants"], state["_flags"], state["_found_taken"] = {}, {}, False
        state.pop("master_weights", None)  # the masters belong to the optimizers
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name, value in (
            ("_rule_constants", {}),
            ("_flags", {}),
            ("_found_taken", False),
        ):
            self.__dict__.setdefault(name, value)  # a scaler pickled by an earlier version
        self.__dict__.pop("_grad_sentinel", None)
        self.master_weights = MasterWeights(self.parameter_names.given)

    def __repr__(self) -> str:
        return f"DynamicLossScaler({self.config!r}, device={self.device})"


def _torch_ceiling(overrides: dict[str, Any]) -> dict[str, Any]:
    """torch's `GradScaler(init_scale=...)` has no ceiling: given an `init_scale` above the default
    `max_scale` and no `max_scale`, the ceiling rises to it (growth then stays at that scale, as torch's
    leaves a scale whose growth would overflow)."""
    init = overrides.get("init_scale")
    default = LossScaleConfig.__dataclass_fields__["max_scale"].default
    if "max_scale" not in overrides and isinstance(init, (int, float)) and not isinstance(init, bool):
        if math.isfinite(init) and init > default:
            return {**overrides, "max_scale": float(init)}
    return overrides


def _check_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(overrides) - set(LossScaleConfig.field_names()))
    if unknown:
        raise TypeError(
            f"DynamicLossScaler got unknown keyword(s) {unknown}; "
            f"config fields are {list(LossScaleConfig.field_names())}."
        )
    return overrides


def _check_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"DynamicLossScaler(device={str(device)!r}) but CUDA is not available on this machine; "
            "pass device='cpu' or device=None (the device of the loss)."
        )
    return device


def _first_tensor_nested(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for v in value:
            t = _first_tensor_nested(v)
            if t is not None:
                return t
    return None
