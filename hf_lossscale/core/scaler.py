"""`DynamicLossScaler`: a configurable, device-side drop-in for `torch.amp.GradScaler`.

Imports only torch. The state (scale, growth and hysteresis trackers, step counters) lives in
0-d tensors on the gradients' device, and `scale()`, `unscale_()` and `update()` never read it
back to the host. `step()` costs no host synchronisation with optimizers that take
`grad_scale`/`found_inf` (torch's fused Adam/AdamW/SGD) and one otherwise, as torch's does.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import warnings
from collections import abc, defaultdict
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch.amp.grad_scaler import OptState  # torch's stages: third-party code compares against them

from .clip import total_norm
from .config import SCALE_MAX, SCALE_MIN, LossScaleConfig
from .scaler_observers import (
    LossScaleCollapseError,
    ParameterNames,
    ScalerObserver,
    SkipWatch,
    default_observers,
)
from .scaler_state import STATE_FORMAT, STATE_FORMAT_VERSION, ScalerState
from .telemetry import FP16_MAX, GradientTelemetry

__all__ = ["DynamicLossScaler", "LossScaleCollapseError", "OptState", "STATE_FORMAT", "STATE_FORMAT_VERSION"]

_MAX_NAMES = 8  # parameter names shown in the FP16-parameter error


def _fresh_optimizer_state() -> dict[str, Any]:
    """An optimizer's per-iteration record, equal to torch's `_refresh_per_optimizer_state()`."""
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _tracing_or_capturing() -> bool:
    """Inside torch.compile's tracing, or a CUDA graph capture: no host work may run."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _RuleConstants(NamedTuple):
    """The scaler's device constants (`DynamicLossScaler._constants`): a 1.0 (`_one`) and the update
    rule's. The counters' factors are
    [K, A] rows (counters * K + A, see `_apply_rule`): `index` picks them from the flags [skipped,
    loss non-finite, True]; `clean`, `skip_ok` and `skip_bad` are them for a step the host knows was
    clean, skipped with a finite loss, skipped with a non-finite one."""

    index: torch.Tensor
    one: torch.Tensor
    false: torch.Tensor
    true: torch.Tensor
    zero: torch.Tensor
    clean: torch.Tensor
    skip_ok: torch.Tensor
    skip_bad: torch.Tensor


# Why a subclass of torch's GradScaler: code that takes "a GradScaler" checks it with isinstance
# (torch's optimizers that take `grad_scaler=`, type-checked training loops), and a drop-in must pass.
# Nothing of torch's implementation runs: __init__ is not called and every method torch's class
# defines is overridden here (tests/test_torch_gradscaler_contract.py holds that to the list).
class DynamicLossScaler(torch.amp.GradScaler):
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

    Args:
        config (`LossScaleConfig`, *optional*): the configuration; defaults to `LossScaleConfig()`.
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
        config: LossScaleConfig | None = None,
        *,
        device: str | torch.device | None = None,
        enabled: bool = True,
        **overrides: Any,
    ) -> None:
        if config is None:
            config = LossScaleConfig(**_torch_ceiling(_check_overrides(overrides)))
        elif not isinstance(config, LossScaleConfig):
            raise TypeError(f"config must be a LossScaleConfig, got {type(config).__name__}.")
        elif overrides:
            config = config.replace(**_check_overrides(overrides))
        if not enabled:
            config = config.replace(mode="off")
        self.config = config
        self._device = _check_device(device) if device is not None else None
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
        self._rule_constants: dict[torch.device, _RuleConstants] = {}  # see _constants
        self._flags: dict[torch.device, tuple[torch.Tensor, ...]] = {}  # see _flag_views
        self._found_taken = False  # whether this iteration's check used the flags buffer (_new_found)
        self._grad_sentinel: torch.nn.Parameter | None = None  # see _drop_stale_probe
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

    def _clamp_growth_tracker(self) -> None:
        """Keep the growth streak below the interval (a streak at or past a lowered interval grows at
        the next clean step either way; torch's kernel needs it below, see `_torch_rule_applies`)."""
        top = self.config.growth_interval - 1
        if self.state.materialised:
            self.state["_growth_tracker"].clamp_(max=top)
        else:
            self.state.host["_growth_tracker"] = min(self.state.host["_growth_tracker"], top)

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

    @property
    def _scale(self) -> torch.Tensor | None:
        return self.state["scale"] if self.state.materialised else None

    @property
    def _enabled(self) -> bool:
        return self.is_enabled()

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        return self.state["_growth_tracker"] if self.state.materialised else None

    @property
    def _init_growth_tracker(self) -> int:
        """torch's name for the growth tracker a scaler starts from: here the current one (a sync)."""
        return self._get_growth_tracker()

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        if self.state.materialised:
            self.state["_growth_tracker"].fill_(int(value))
        else:
            self.state.host["_growth_tracker"] = int(value)
        self._clamp_growth_tracker()

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        if not self.state.materialised:
            self.state.materialise(torch.device(dev))

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        self._require_init(funcname)
        return self._scale, self.state["_growth_tracker"]

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
                self._note_loss(val)
                scale = per_device.get(val.device)
                if scale is None:
                    scale = self._scale.to(device=val.device, non_blocking=True)
                    per_device[val.device] = scale
                return val * scale
            if isinstance(val, (list, tuple)):
                return type(val)(apply(v) for v in val)
            if isinstance(val, abc.Iterable):
                return map(apply, val)
            raise ValueError("scale() takes a Tensor or an iterable of Tensors.")

        return apply(outputs)

    def _note_loss(self, loss: torch.Tensor) -> None:
        """Keep a device probe of the loss (no host sync): a non-finite loss is a forward overflow,
        which no scale can fix. One op: `loss * 0` is 0 when the loss is finite and NaN otherwise, and
        the gradients' overflow check reads it in the same kernel call (see `_unscale_grads_`). A
        1-element loss on the scale's device writes it into the flags buffer (`_flag_views`)."""
        loss = loss.detach()
        self._drop_stale_probe()
        if loss.device == self._scale.device and loss.numel() == 1:
            _, _, in_buffer = self._flag_views(loss.device)
            if self._loss_probe is None:  # the iteration's first loss
                torch.mul(loss.reshape(()), 0, out=in_buffer)
                self._loss_probe = in_buffer
                return
            if self._loss_probe is in_buffer:  # more losses (accumulation): added in place, still one op
                self._loss_probe.add_(loss.reshape(()), alpha=0)
                return
        probe = loss.mul(0)
        if probe.numel() != 1:
            probe = probe.sum()
        probe = probe.reshape(()).to(self._scale.device, non_blocking=True)
        self._loss_probe = probe if self._loss_probe is None else self._loss_probe + probe

    def _drop_stale_probe(self) -> None:
        """Forget the probe of losses whose gradients were thrown away: a loss scaled in an iteration
        that never reached `update()` (a bad batch dropped by hand: `zero_grad(); continue`) must not
        make the next, clean step a skip, as torch's scaler steps it. Told from accumulation by a
        parameter that had a gradient at the first step (`_grad_sentinel`): `zero_grad()` (which sets
        gradients to None by default) left it without one, and no optimizer was unscaled or stepped
        since. A host check of one attribute; `zero_grad(set_to_none=False)` is not seen."""
        if (
            self._loss_probe is not None
            and self._grad_sentinel is not None
            and self._grad_sentinel.grad is None
            and not self._per_optimizer_states
        ):
            self._loss_probe = None

    def _flag_views(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The flags buffer on `device` (made once) and its first two elements as 0-d views:
        [found-inf flag, loss probe, 1.0]. The first optimizer's check on the scale's device writes
        its flag into it, the first loss its probe, so that `update()` reads both with one compare of
        the buffer (no stack of 0-d tensors). The views are made once: code that traces the scaler
        sees the same tensors at every step."""
        views = self._flags.get(device)
        if views is None:
            buffer = torch.zeros(3, device=device)  # made on the device: no copy from the host
            buffer[2].fill_(1.0)
            views = self._flags[device] = (buffer, buffer[0], buffer[1])
        return views

    def _new_found(self, device: torch.device) -> torch.Tensor:
        """A zero found-inf flag on `device`: the flags buffer's, for the iteration's first check on the
        scale's device, else a fresh one. One op either way."""
        if device == self._scale.device and not self._found_taken:
            self._found_taken = True
            return self._flag_views(device)[1].zero_()
        return torch.zeros((), dtype=torch.float32, device=device)

    @property
    def loss_finite_tensor(self) -> torch.Tensor | None:
        """A 0-d bool device flag: were all losses `scale()` saw since the last `update()` finite?
        None before the first `scale()` of the iteration. No sync (one device op when asked)."""
        return None if self._loss_probe is None else self._loss_probe.eq(0)

    @property
    def last_backed_off(self) -> torch.Tensor | None:
        """A 0-d bool device flag: did the last update back the scale off? No sync."""
        if self._backed_off is not None and self._backed_off.dtype != torch.bool:
            self._backed_off = self._backed_off > 0  # one op, only when someone asks
        return self._backed_off

    def _one(self, device: torch.device) -> torch.Tensor:
        """A 1.0 on `device` (a fused step's divisor, the check's unit scale), made once."""
        return self._constants(device).one

    # ------------------------------------------------------------------ unscale / check
    def _grads_by_device_and_dtype(self, optimizer: torch.optim.Optimizer, allow_fp16: bool = False):
        grouped: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        fp16_params = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.dtype == torch.float16 and not allow_fp16:
                    fp16_params.append(self.parameter_names.name(param, optimizer))
                    continue
                grad = param.grad
                if grad.is_sparse:
                    if grad.dtype is torch.float16:
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                grouped[grad.device][grad.dtype].append(grad)
        if fp16_params:
            shown = ", ".join(fp16_params[:_MAX_NAMES])
            more = f" (and {len(fp16_params) - _MAX_NAMES} more)" if len(fp16_params) > _MAX_NAMES else ""
            raise ValueError(
                f"{len(fp16_params)} trainable parameter(s) are held in float16: {shown}{more}. "
                "Loss scaling needs FP32 master weights: load the model in float32 (drop "
                "`torch_dtype=torch.float16` / `dtype=torch.float16` from from_pretrained) and let "
                "autocast (`fp16=True` / `mixed_precision='fp16'`) run the FP16 compute, or freeze "
                "those parameters."
            )
        return grouped

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor | None = None,
        allow_fp16: bool | None = None,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale in place and fill one found-inf flag per device (no host sync).

        With torch's arguments (`found_inf`, `allow_fp16`, as `GradScaler._unscale_grads_` takes them,
        for code that calls it) the flags accumulate into `found_inf` (a copy of it on other
        devices) without this iteration's loss flag, and `allow_fp16=True` unscales gradients of
        FP16 parameters too; by default FP16 parameters are refused with an explanation.
        """
        found: dict[torch.device, torch.Tensor] = {}
        inv: dict[torch.device, torch.Tensor] = {}

        def flag_for(device: torch.device) -> torch.Tensor:
            if found_inf is None:
                return self._new_found(device)
            return found_inf if found_inf.device == device else found_inf.to(device, non_blocking=True)

        # the loss probe (0, or NaN after a non-finite loss) joins its device's check: the step is then
        # skipped whatever the gradients hold, at no extra op (our private tensor: unscaling it is harmless)
        probe = self._loss_probe if found_inf is None else None
        for observer in self._watchers():
            observer.before_unscale(self, optimizer)
        with torch.no_grad():
            grouped = self._grads_by_device_and_dtype(optimizer, bool(allow_fp16))
            if probe is not None:
                grouped[probe.device][probe.dtype] = [*grouped[probe.device][probe.dtype], probe]
            for device, per_dtype in grouped.items():
                if device not in found:
                    found[device] = flag_for(device)
                    inv[device] = inv_scale.to(device, non_blocking=True)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found[device], inv[device])
        if not found:  # no gradients and no loss: a clean flag on the scale's device
            home = self._scale.device if self._scale is not None else inv_scale.device
            found[home] = flag_for(home)
        if self._found_inf_group is not None:
            import torch.distributed as dist

            flag = torch.stack([f.reshape(()).to(self._scale.device) for f in found.values()]).amax()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._found_inf_group)
            found = {flag.device: flag}
        return found

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

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """Check for inf/NaN without unscaling (fused optimizers unscale inside their kernel)."""
        self._require_init("step")
        found = self._unscale_grads_(optimizer, self._one(self._scale.device))
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

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
        if not self.is_enabled():
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not supported when loss scaling is enabled.")
        self._require_init("step")
        if self._grad_sentinel is None:  # see _drop_stale_probe
            self._grad_sentinel = next(
                (p for g in optimizer.param_groups for p in g["params"] if p.grad is not None), None
            )
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if self.config.at_min_scale == "clamp":
            return self._step_clamping(optimizer, state, args, kwargs)

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if _takes_grad_scaler(optimizer.step):
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
            if _fused_sgd_first_step(optimizer) and found_inf.item():
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

    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        """torch's helper: step unless a found-inf flag is set (reads the flags: one host sync)."""
        if not sum(v.item() for v in optimizer_state["found_inf_per_device"].values()):
            return optimizer.step(*args, **kwargs)
        return None

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
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if parameters is not None:
            parameters = list(parameters)
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
            # the norm is inf/NaN exactly when a gradient is; one kernel checks it and the loss probe
            # (multiplying them by 1 in place leaves their values as they are)
            found = self._new_found(device)
            checked = [norm] if self._loss_probe is None else [norm, self._loss_probe.to(device)]
            torch._amp_foreach_non_finite_check_and_unscale_(checked, found, self._one(device))
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
                _mul_grads_(grouped, torch.where(found > 0, self._one(device), multiplier), foreach)
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
                _mul_grads_(
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
        distributed = _world_size(self._found_inf_group) > 1
        fast_rule = self.config.mode != "dynamic" or self._torch_rule_applies()  # else the general one
        host_known = self._host_skipped is not None and fast_rule
        if host_known and not distributed and self.config.at_min_scale != "clamp":
            # The host read the flags (the non-fused path does). A clean step, and so a finite loss
            # (the loss probe joined every check): the rule's clean branch from constants, no flags.
            # A skipped one: the skip branch, whose only device input is whether the loss was finite.
            self._apply_known_rule(found_f.device, self._host_skipped, probe)
        elif probe is not None and not distributed:
            # [skipped, loss non-finite, True]: the probe is 0 or NaN, and NaN != 0. One op where the
            # flag and the probe sit in the flags buffer (the usual case), else two (a stack)
            buffer, found_view, probe_view = self._flag_views(found_f.device)
            if found_f is found_view and probe is probe_view:
                bits = buffer.ne(0)
            else:
                bits = torch.stack([found_f, probe.to(found_f.dtype), self._one(found_f.device)]).ne(0)
            self._apply_rule(bits[0], bits[1], bits)
        else:
            loss_bad = None if probe is None else probe.ne(0)
            if distributed:
                loss_bad = self._all_ranks_loss_flag(loss_bad)
            self._apply_rule(found_f > 0, loss_bad)
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
        self._notify_update(rule_applied=True)

    def _all_ranks_loss_flag(self, loss_bad: torch.Tensor | None) -> torch.Tensor:
        """Whether any rank's loss was non-finite: one 1-element all-reduce (MAX) on the device, no host
        sync. Under DDP one rank's non-finite loss makes every rank's gradients non-finite; without
        this, that rank would spare the scale while the others back off, and the replicas' scales (and
        later their skips) would drift apart. Every rank takes part, with 0 when it saw no loss."""
        import torch.distributed as dist

        if loss_bad is None:
            flag = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        else:
            flag = loss_bad.to(torch.float32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._found_inf_group)
        return flag > 0

    def _apply_rule(
        self, found: torch.Tensor, loss_bad: torch.Tensor | None = None, bits: torch.Tensor | None = None
    ) -> None:
        """The update rule on the device tensors; `found` is a 0-d bool tensor (the step was skipped),
        `loss_bad` whether a loss of the iteration was non-finite (None: no loss was seen); `bits`, when
        the caller has it, the bool vector [found, loss_bad, True].

        A skip whose loss was non-finite is a forward overflow: unless `backoff_on_nonfinite_loss`,
        it leaves the scale and the trackers as they were (no scale can fix it).

        Device ops are kept few (each is a kernel launch on a GPU): the five counters advance together
        (`ScalerState.counters`: x K + A, with K and A picked from the step's flags in one index op),
        and where the rule is torch's (`_torch_rule_applies`) the scale and growth tracker move with
        torch's own `_amp_update_scale_` kernel and one clamp.
        """
        c, s = self.config, self.state
        bad = loss_bad if loss_bad is not None else torch.zeros_like(found)
        # flags = [skipped, loss non-finite, 1]; K = flags[[0, 1, 2, 2, 2]], A = flags[[0, 1, 2, 0, 1]]:
        # consecutive = (consecutive + 1) * flag, total += 1, skipped += flag, nonfinite += flag
        k = self._constants(found.device)
        if bits is None:
            bits = torch.stack([found, bad, k.true])
        factors = bits[k.index]  # bool: multiplying and adding them into the int64 counters promotes
        torch.addcmul(factors[1], s.counters, factors[0], out=s.counters)  # counters * K + A, one op
        s.replace("last_step_skipped", found)  # a fresh tensor each update: holders keep a snapshot
        self.last_loss_nonfinite = loss_bad
        self._backed_off = None
        if c.mode != "dynamic":
            return
        neutral = None if loss_bad is None or c.backoff_on_nonfinite_loss else loss_bad
        if self._torch_rule_applies():
            # the backoff decision: a skip that is not a forward overflow (skipped > loss non-finite)
            overflow = torch.gt(bits[0], bits[1], out=self._overflow_buffer()) if neutral is not None else (
                found.to(torch.float32))  # fmt: skip
            if neutral is not None:  # a forward overflow neither advances nor resets the growth streak:
                # (the kernel's +1 for a clean step brings it back)
                s["_growth_tracker"].add_(bits[1], alpha=-1)
            torch._amp_update_scale_(
                s["scale"],
                s["_growth_tracker"],
                overflow,
                c.growth_factor,
                c.backoff_factor,
                c.growth_interval,
            )
            s["scale"].clamp_(c.min_scale, c.max_scale)
            self._backed_off = overflow
            return
        scale, growth, hyst = s["scale"], s["_growth_tracker"], s["_hysteresis_tracker"]
        overflow = found if neutral is None else found & ~neutral
        growth_after = torch.where(overflow, 0, growth + 1)
        if neutral is not None:  # a forward overflow neither resets nor advances the growth streak
            growth_after = torch.where(neutral, growth, growth_after)
        grow = growth_after >= c.growth_interval
        if c.hysteresis == 1:  # a budget of one: every overflow backs off, the tracker stays full
            back_off = overflow
        else:
            hyst_after_overflow = (hyst - 1).clamp_(min=0)
            back_off = overflow & (hyst_after_overflow == 0)
        self._backed_off = back_off
        # Compute in float64 and round once, as torch's _amp_update_scale_ kernels do.
        grown = (scale.double() * c.growth_factor).clamp_(max=c.max_scale).float()
        backed = (scale.double() * c.backoff_factor).clamp_(min=c.min_scale).float()
        scale.copy_(torch.where(back_off, backed, torch.where(grow, grown, scale)))
        growth.copy_(torch.where(grow, 0, growth_after))
        if c.hysteresis > 1:
            refill = grow | (~found) if c.consecutive_hysteresis else grow
            hyst.copy_(torch.where(overflow, hyst_after_overflow, torch.where(refill, c.hysteresis, hyst)))

    def _apply_known_rule(self, device: torch.device, skipped: bool, probe: torch.Tensor | None) -> None:
        """`_apply_rule` for a step whose skip the host already knows (the non-fused path reads the
        flag), where the rule is torch's: constants stand in for the flags. A clean step had a finite
        loss (the probe joined the check): fixed counters' factors (streaks end, one more step) and a
        zero backoff flag, three ops (static mode: one). A skipped one: only whether its loss was
        non-finite comes from the device (the probe: 0 or NaN); it picks one of two factor pairs (K, A
        for [1, b, 1]: see `_apply_rule`) and, where such a skip is neutral, clears the backoff flag:
        seven ops with a probe (the general branch: eight), three without."""
        c, s, k = self.config, self.state, self._constants(device)
        if not skipped:
            loss_bad, factors, overflow = (k.false if probe is not None else None), k.clean, k.zero
        else:
            loss_bad = None if probe is None else probe.ne(0)
            factors = k.skip_ok if loss_bad is None else torch.where(loss_bad, k.skip_bad, k.skip_ok)
            overflow = self._one(device)
        torch.addcmul(factors[1], s.counters, factors[0], out=s.counters)
        s.replace("last_step_skipped", k.true if skipped else k.false)  # constants nobody writes to
        self.last_loss_nonfinite = loss_bad
        self._backed_off = None
        if c.mode != "dynamic":
            return
        if skipped and loss_bad is not None and not c.backoff_on_nonfinite_loss:  # a neutral skip
            overflow = torch.eq(loss_bad, False, out=self._overflow_buffer())
            s["_growth_tracker"].add_(loss_bad, alpha=-1)  # (the kernel's +1 for "no overflow" undone)
        torch._amp_update_scale_(
            s["scale"], s["_growth_tracker"], overflow, c.growth_factor, c.backoff_factor, c.growth_interval
        )
        s["scale"].clamp_(c.min_scale, c.max_scale)
        self._backed_off = overflow if skipped else k.false

    def _constants(self, device: torch.device) -> _RuleConstants:
        """The scaler's constants on `device`, made once (at the first step that needs one)."""
        found = self._rule_constants.get(device)
        if found is None:

            def tensor(value, dtype=None):
                return torch.tensor(value, dtype=dtype, device=device)

            found = self._rule_constants[device] = _RuleConstants(
                index=tensor([[0, 1, 2, 2, 2], [0, 1, 2, 0, 1]]),
                one=tensor(1.0, torch.float32),
                false=tensor(False),
                true=tensor(True),
                zero=tensor(0.0, torch.float32),
                clean=tensor([[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]),
                skip_ok=tensor([[1, 0, 1, 1, 1], [1, 0, 1, 1, 0]]),
                skip_bad=tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]),
            )
        return found

    def _overflow_buffer(self) -> torch.Tensor:
        return torch.empty((), dtype=torch.float32, device=self._scale.device)

    def _torch_rule_applies(self) -> bool:
        """Whether torch's `_amp_update_scale_` kernel computes this config's rule exactly: no hysteresis
        (a budget of one overflow: every overflow backs off, the tracker stays full), power-of-two
        factors (exact in FP32 as in FP64), and a ceiling whose growth stays finite in FP32 (the kernel
        keeps a scale whose growth overflows; ours clamps to the ceiling, which is then the same). The
        growth tracker is kept below the interval (`_clamp_growth_tracker`), since the kernel grows
        only when the streak *equals* the interval."""
        c = self.config
        return (
            c.hysteresis == 1
            and _power_of_two(c.growth_factor)
            and _power_of_two(c.backoff_factor)
            and c.max_scale * c.growth_factor <= SCALE_MAX
        )

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

    # ------------------------------------------------------------------ reading state
    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 in `"off"` mode). Synchronises with the device."""
        if not self.is_enabled():
            return 1.0
        return self.state.host["scale"] if self._scale is None else self._scale.item()

    def _get_growth_tracker(self) -> int:
        if not self.state.materialised:
            return self.state.host["_growth_tracker"]
        return self.state["_growth_tracker"].item()

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
        state["_grad_sentinel"] = None  # a parameter of the model: not the scaler's to carry
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name, value in (
            ("_rule_constants", {}),
            ("_flags", {}),
            ("_found_taken", False),
            ("_grad_sentinel", None),
        ):
            self.__dict__.setdefault(name, value)  # a scaler pickled by an earlier version

    def __repr__(self) -> str:
        return f"DynamicLossScaler({self.config!r}, device={self.device})"


def _world_size(group: Any = None) -> int:
    """The number of ranks in `group` (the world by default); 1 without an initialised process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _fused_sgd_first_step(optimizer: torch.optim.Optimizer) -> bool:
    """A fused SGD with momentum whose momentum buffers do not exist yet (its first step)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    return any(
        group.get("fused")
        and group["momentum"] != 0
        and any(
            p.grad is not None and "momentum_buffer" not in optimizer.state.get(p, {})
            for p in group["params"]
        )
        for group in optimizer.param_groups
    )


def _mul_grads_(grouped: dict, factor: torch.Tensor, foreach: bool | None) -> None:
    """Multiply gradients grouped by device and dtype by a 0-d tensor, in place, as torch's
    `clip_grads_with_norm_` does (foreach where supported, else tensor by tensor)."""
    from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support

    for device, per_dtype in grouped.items():
        f = factor.to(device, non_blocking=True)
        for grads in per_dtype.values():
            if (foreach is None and _has_foreach_support(grads, device)) or (
                foreach and _device_has_foreach_support(device)
            ):
                torch._foreach_mul_(grads, f)
            elif foreach:
                raise RuntimeError(
                    f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
                )
            else:
                for g in grads:
                    g.mul_(f)


def _takes_grad_scaler(step: Any) -> bool:
    """Whether an optimizer's `step` takes `grad_scaler=` (torch's older contract); the signature is
    read once per step function, not on every step."""
    func = getattr(step, "__func__", step)
    try:
        return _signature_takes_grad_scaler(func)
    except TypeError:  # an unhashable callable: read its signature each time
        return "grad_scaler" in inspect.signature(func).parameters


@functools.lru_cache(maxsize=64)
def _signature_takes_grad_scaler(func: Any) -> bool:
    return "grad_scaler" in inspect.signature(func).parameters


def _power_of_two(x: float) -> bool:
    mantissa, _ = math.frexp(x)
    return x > 0 and mantissa == 0.5


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
