"""Everything that touches Accelerate: `install_loss_scaler` puts a `DynamicLossScaler` in charge.

Nothing here patches Accelerate globally. On the one `Accelerator` it is given, the hook sets
`scaler` (Accelerate's own slot), keeps what it installed in one namespace, `accelerator.hf_lossscale`
(a `LossScaleInstall`), and wraps three of its methods: `prepare_model` and `prepare_optimizer` (so
what is prepared later gets the scaler and the FP16 compute) and `clip_grad_norm_` (one read of the
gradients). On a CPU it also turns `native_amp` on
(Accelerate's gate for unscaling); when FP16 is emulated, the prepared models' forward runs under the
emulation and the scaler's scaled loss runs its backward under it (`core.scaled_loss`), so
`accelerator.backward` and `accelerator.autocast` stay Accelerate's own. Optimizers are wrapped through
`AcceleratedOptimizer`'s own constructor; only where accelerate issue 4242 exists
(`compat.accelerate_has_4242`) are they `LossScaledOptimizer`s.

Install before `prepare()`: that is the supported path, where Accelerate itself builds each
optimizer's step machinery around the scaler. Installed after `prepare()`, the optimizers already
handed out are adapted in place (their step machinery rebuilt through `AcceleratedOptimizer`'s own
`__setstate__`, and, under issue 4242, their class made `LossScaledOptimizer`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from types import MethodType
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType, convert_outputs_to_fp32

from ..core.config import LossScaleConfig, resolve_config
from ..core.scaler import DynamicLossScaler
from ..core.scaler_observers import ScalerObserver
from ..fp16.emulation import fp16_emulation
from ..fp16.fp32_modules import run_in_fp32
from ..masters.optimizer_wrappers import inner_optimizer
from .compat import accelerate_has_4242, warn_if_untested
from .resume import LOAD_CONFIG_WARNINGS, restore_settings, resume_line

__all__ = [
    "install_loss_scaler",
    "LossScaleInstall",
    "LossScaledOptimizer",
    "effective_mixed_precision",
    "fp16_context",
    "fp16_kind",
    "plain_forward",
    "needs_found_inf_sync",
]

logger = logging.getLogger(__name__)

_OWN_SCALER = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


class LossScaledOptimizer(AcceleratedOptimizer):
    """`AcceleratedOptimizer` whose `step_was_skipped` comes from the scaler's device-side flag.

    Accelerate decides "skipped" by whether `optimizer.step` was called, which is wrong for fused
    optimizers: they are always called and skip inside the kernel
    (https://github.com/huggingface/accelerate/issues/4242; used only where
    `compat.accelerate_has_4242()`).
    With a fused optimizer, reading `step_was_skipped` costs one host read of a 0-d device tensor,
    once per step however many callers ask; otherwise `scaler.step()` already read the flag and
    reading it costs nothing.
    """

    def step(self, closure=None):
        super().step(closure)
        scaler = self.scaler
        if self.gradient_state.sync_gradients and isinstance(scaler, DynamicLossScaler):
            flag = scaler.step_skipped_tensor
            self._skip_flag = flag if scaler.is_enabled() else None  # a snapshot: update() replaces it
            self._skip_value = scaler.last_step_skipped_if_known  # None: only the device knows

    @property
    def step_was_skipped(self) -> bool:
        flag = getattr(self, "_skip_flag", None)
        if flag is None:
            return self._is_overflow
        if getattr(self, "_skip_value", None) is None:
            self._skip_value = bool(flag.item())
        return self._skip_value


@dataclasses.dataclass
class LossScaleInstall:
    """What `install_loss_scaler` put on an Accelerator, in one place: `accelerator.hf_lossscale`.

    Args:
        scaler (`DynamicLossScaler`): the scaler installed (also `accelerator.scaler`).
        fp16 (`str`): the FP16 compute of the run: `"emulated"`, `"native-cpu"` or `"cuda"`.
        context (`Callable`, *optional*): the FP16 compute context on a CPU (None elsewhere).
    """

    scaler: DynamicLossScaler
    fp16: str
    context: Callable[[], contextlib.AbstractContextManager] | None = None
    #: the `load_state` pre-hook's handle (the resume rule)
    load_hook: Any = None
    #: whether prepare_model / prepare_optimizer, clip_grad_norm_ are wrapped
    prepare_wrapped: bool = False
    clip_routed: bool = False


def _installed(accelerator: Any) -> LossScaleInstall | None:
    found = getattr(accelerator, "hf_lossscale", None)
    return found if isinstance(found, LossScaleInstall) else None


def fp16_kind(accelerator: Any) -> str | None:
    """The FP16 compute `install_loss_scaler` set up (`"emulated"`, `"native-cpu"`, `"cuda"`), or None."""
    found = _installed(accelerator)
    return found.fp16 if found is not None else None


def fp16_context(accelerator: Any) -> Callable[[], contextlib.AbstractContextManager] | None:
    """The CPU FP16 compute context `install_loss_scaler` set up (emulation or CPU autocast), or None."""
    found = _installed(accelerator)
    return found.context if found is not None else None


def effective_mixed_precision(accelerator: Accelerator) -> str:
    """`"fp16"`, `"bf16"`, `"fp8"` or `"no"`, as the accelerator's state resolved it."""
    return str(accelerator.state.mixed_precision)


def install_loss_scaler(
    accelerator: Accelerator,
    config: LossScaleConfig | None = None,
    *,
    overrides: dict[str, Any] | None = None,
) -> DynamicLossScaler | None:
    """Replace `accelerator.scaler` with a `DynamicLossScaler`, before or after `prepare()`.

    The config comes from `config` if given, else from `overrides` (fields set as arguments), the
    `HF_LOSSSCALE_<FIELD>` environment variables and the file named by `HF_LOSSSCALE_CONFIG`, in
    that order, over the defaults: a script calling `install_loss_scaler(accelerator)` can be
    reconfigured under `accelerate launch` without code changes.

    On a CPU with `mixed_precision="fp16"` (where Accelerate silently trains in FP32) it turns on
    FP16 numerics for the prepared models' forward (evaluation included) and for
    `accelerator.backward`: by default emulated (`fp16_emulation(policy="cuda")`: FP16 rounding,
    underflow and overflow at FP32 speed), or with `fp16_on_cpu="native"` real
    `torch.autocast("cpu", dtype=torch.float16)`, about 20x slower than FP32 (for correctness work
    and demos). Which one ran is logged and kept in `accelerator.hf_lossscale.fp16` (`"emulated"`,
    `"native-cpu"` or `"cuda"`; `fp16_kind(accelerator)`).

    Install it before `accelerator.prepare(...)`: the supported path. After `prepare()` it still
    works, adapting the optimizers already prepared in place.

    A resume through `accelerator.load_state` follows the Trainer's rule: every setting comes from
    this run's config, the checkpoint gives the dynamic state (scale, trackers, counters, the modules
    `fp32_modules="auto"` moved), and one line lists the settings that differ from the checkpoint's.
    (A plain `scaler.load_state_dict` keeps torch's semantics.)

    `accelerator.clip_grad_norm_` then unscales, checks and clips in one read of the gradients
    (`DynamicLossScaler.clip_grad_norm_`) when its parameters are exactly one prepared optimizer's;
    it returns the unscaled norm as before.

    Returns the scaler, or `None` (with a warning) when the run is not FP16: bf16/FP32 need no
    loss scaling.

    Raises:
        RuntimeError: under DeepSpeed or Megatron-LM, whose engines own their scaler.

    Example:

    ```python
    >>> from accelerate import Accelerator
    >>> from hf_lossscale import install_loss_scaler, LossScaleConfig
    >>> accelerator = Accelerator(mixed_precision="fp16")
    >>> scaler = install_loss_scaler(accelerator, LossScaleConfig(min_scale=16.0, hysteresis=2))
    >>> model, optimizer = accelerator.prepare(model, optimizer)  # doctest: +SKIP
    ```
    """
    if accelerator.distributed_type in _OWN_SCALER:
        raise RuntimeError(
            f"install_loss_scaler: this run uses {accelerator.distributed_type.value}, whose engine owns "
            "its loss scaler. Configure loss scaling in the engine's own config instead (for DeepSpeed, "
            "its `fp16` section: loss_scale 0, initial_scale_power, loss_scale_window, hysteresis, "
            "min_loss_scale)."
        )
    precision = effective_mixed_precision(accelerator)
    if precision != "fp16":
        warnings.warn(
            f"install_loss_scaler: mixed_precision={precision!r}, not 'fp16'; loss scaling is not "
            "needed and no scaler was installed.",
            stacklevel=2,
        )
        return None
    config = _seed_from_grad_scaler_kwargs(accelerator, resolve_config(config, overrides))
    warn_if_untested()

    scaler = DynamicLossScaler(config, device=accelerator.device)
    if needs_found_inf_sync(accelerator):
        scaler.sync_found_inf_across()  # FSDP1: gradients are local flat shards
    previous = _installed(accelerator)
    accelerator.scaler = scaler
    install = LossScaleInstall(scaler, fp16=accelerator.device.type)
    if previous is not None:  # installed again: the wrappers stay, they read the namespace
        install.prepare_wrapped, install.clip_routed = previous.prepare_wrapped, previous.clip_routed
        if previous.load_hook is not None:
            previous.load_hook.remove()
    accelerator.hf_lossscale = install
    if accelerator.device.type == "cpu":
        _enable_cpu_fp16(accelerator, config.fp16_on_cpu)
    for opt in accelerator._optimizers:
        _attach_to_optimizer(opt, scaler)  # prepared before the scaler: adapted in place
    for model in accelerator._models:
        scaler.set_parameter_names(accelerator.unwrap_model(model, keep_fp32_wrapper=True))
        _apply_fp32_modules(accelerator.unwrap_model(model), scaler)
    _hook_prepare(accelerator)
    _route_clip(accelerator)
    rule = _ResumeRule(accelerator, scaler)
    scaler.observers.append(rule)
    install.load_hook = accelerator.register_load_state_pre_hook(rule.before_load)
    logger.info("hf_lossscale: installed %r", scaler)
    return scaler


class _ResumeRule(ScalerObserver):
    """`accelerator.load_state` with our scaler: the Trainer's resume rule (every setting from this
    run, the dynamic state from the checkpoint, one line for what differs). Armed by a `load_state`
    pre-hook (Accelerate's public one) only when the checkpoint holds a scaler state, so a plain
    `scaler.load_state_dict` keeps torch's semantics."""

    def __init__(self, accelerator: Accelerator, scaler: DynamicLossScaler) -> None:
        self.accelerator = accelerator
        self.scaler = scaler
        self._armed: tuple[LossScaleConfig, dict[str, Any], str, list] | None = None

    def before_load(self, models: list[Any], input_dir: str) -> None:
        self._disarm()
        path = os.path.join(input_dir, "scaler.pt")  # accelerate.utils.SCALER_NAME
        if self.accelerator.scaler is not self.scaler or not os.path.isfile(path):
            return
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - Accelerate's own load reports an unreadable file
            return
        if not isinstance(saved, dict):
            return
        # the scaler's own warnings about the config (torch's fields restored; fields that differ):
        # the one line after the load replaces them
        filters = []
        for message in LOAD_CONFIG_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
            filters.append(warnings.filters[0])
        self._armed = (self.scaler.config, saved, path, filters)

    def _disarm(self) -> None:
        if self._armed is not None:
            for entry in self._armed[3]:
                if entry in warnings.filters:
                    warnings.filters.remove(entry)  # (an "ignore" filter leaves no registry entry behind)
            self._armed = None

    def on_state_loaded(self, scaler: DynamicLossScaler) -> None:
        armed = self._armed
        self._disarm()
        if armed is None or scaler is not self.scaler:
            return
        current, saved, path, _ = armed
        restore_settings(scaler, current)
        line = resume_line(saved, current, path, scale=scaler.state.host["scale"])
        if line:
            logger.warning(line)
        if scaler.state.fp32_modules:  # what "auto" moved to FP32 before the checkpoint stays there
            for model in self.accelerator._models:
                run_in_fp32(
                    self.accelerator.unwrap_model(model), scaler.state.fp32_modules, include_model_own=False
                )


def _apply_fp32_modules(model: torch.nn.Module, scaler: DynamicLossScaler) -> None:
    """Run the configured `fp32_modules` patterns, the model's own `_keep_in_fp32_modules` and the
    modules a loaded state's `"auto"` moved, in FP32. A configured pattern matching nothing is an error."""
    wrapped = run_in_fp32(model, scaler.config.fp32_patterns)
    if scaler.state.fp32_modules:
        wrapped += run_in_fp32(model, scaler.state.fp32_modules, include_model_own=False)
    if wrapped:
        logger.warning("hf_lossscale: these modules run in FP32 inside the FP16 run: %s", wrapped)


def needs_found_inf_sync(accelerator: Any) -> bool:
    """Whether the scaler must all-reduce its found-inf flag itself: only under FSDP1, whose
    gradients are local shards. DDP all-reduces gradients before the check, and FSDP2's DTensor
    gradients have torch reduce the flag; adding a collective there would only cost time."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return False
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return int(getattr(plugin, "fsdp_version", 1) or 1) == 1


_TORCH_FIELDS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


def _seed_from_grad_scaler_kwargs(accelerator: Accelerator, config: LossScaleConfig) -> LossScaleConfig:
    """Accelerate's `GradScalerKwargs` (the `kwargs_handlers` a user gave the accelerator) seed the
    config: each field it sets is taken, unless the loss-scale config sets that field itself (a value
    other than its default, from code, arguments, `HF_LOSSSCALE_*` or the config file), which wins.
    One warning line says which came from where; `enabled=False` turns loss scaling off."""
    handler = getattr(accelerator, "scaler_handler", None)
    if handler is None:
        return config
    given = handler.to_kwargs()  # only the fields that differ from GradScalerKwargs' defaults
    defaults = LossScaleConfig()
    taken, kept = {}, {}
    for name in _TORCH_FIELDS:
        if name not in given:
            continue
        if getattr(config, name) == getattr(defaults, name):
            taken[name] = given[name]
        elif getattr(config, name) != given[name]:
            kept[name] = (given[name], getattr(config, name))
    if given.get("enabled") is False:
        taken["mode"] = "off"
    if (
        "init_scale" in taken
        and taken["init_scale"] > config.max_scale
        and config.max_scale == defaults.max_scale
    ):
        taken["max_scale"] = float(taken["init_scale"])  # torch's scaler has no ceiling
    if taken:
        config = config.replace(**taken)
    if taken or kept:
        parts = []
        if taken:
            parts.append("taken: " + ", ".join(f"{k}={v}" for k, v in taken.items()))
        if kept:
            parts.append(
                "the loss-scale config wins for: "
                + ", ".join(f"{k} (GradScalerKwargs {g}, config {c})" for k, (g, c) in kept.items())
            )
        warnings.warn(f"install_loss_scaler: GradScalerKwargs {'; '.join(parts)}.", stacklevel=3)
    return config


# ---------------------------------------------------------------------- optimizers
def _attach_to_optimizer(opt: Any, scaler: DynamicLossScaler) -> None:
    """Point an optimizer prepared before the scaler existed at it, in place (the caller holds it).

    Accelerate builds an `AcceleratedOptimizer`'s step machinery only when it has a scaler; its own
    `__setstate__` (the unpickling path) builds it for the scaler given, so nothing private is
    written here. Under accelerate issue 4242 its class becomes `LossScaledOptimizer` (the one
    object the caller already holds cannot be replaced by a new wrapper)."""
    if not isinstance(opt, AcceleratedOptimizer):
        return
    if opt.scaler is not scaler:
        opt.__setstate__({"scaler": scaler})
    if accelerate_has_4242() and type(opt) is AcceleratedOptimizer:
        opt.__class__ = LossScaledOptimizer
    _attach_masters(opt, scaler)


def _wrap_prepared_optimizer(accelerator: Accelerator, prepared: Any, scaler: DynamicLossScaler) -> Any:
    """An optimizer `prepare()` just wrapped, with the scaler installed before (the supported path):
    Accelerate built its step machinery around the scaler; under accelerate issue 4242 it is
    re-wrapped through `LossScaledOptimizer`'s own constructor (the state is on its device already)."""
    if not isinstance(prepared, AcceleratedOptimizer):
        return prepared
    if prepared.scaler is not scaler:  # another scaler was in the slot when it was prepared
        _attach_to_optimizer(prepared, scaler)
        return prepared
    wrapped = prepared
    if accelerate_has_4242() and type(prepared) is AcceleratedOptimizer:
        wrapped = LossScaledOptimizer(prepared.optimizer, device_placement=False, scaler=scaler)
        accelerator._optimizers[:] = [wrapped if o is prepared else o for o in accelerator._optimizers]
    _attach_masters(wrapped, scaler)
    return wrapped


#: Optimizers that update the weights inside the backward (`accelerator.backward(loss, learning_rate=...)`),
#: with no step for a loss scaler to check or skip: lomo-optim's LOMO and AdaLomo.
FUSED_BACKWARD = ("Lomo", "AdaLomo")


def _refuse_fused_backward(optimizer: Any) -> None:
    name = type(inner_optimizer(optimizer)).__name__
    if name in FUSED_BACKWARD:
        raise ValueError(
            f"install_loss_scaler: {name} (optim='{name.lower()}') updates the weights inside the backward, so "
            "no step is left for the loss scaler to check for inf/NaN or skip; it keeps its own loss scale in "
            "FP16. Use it without hf_lossscale (plain `Trainer`, no `install_loss_scaler`), or an optimizer "
            "that steps (`adamw_torch_fused`, `adafactor`) with the loss scaler."
        )


def _attach_masters(opt: Any, scaler: DynamicLossScaler) -> None:
    if scaler.config.master_weights is not False:
        # a model held in FP16: its masters now, so that `load_state` restores them and a clip from
        # the first step on sees them
        scaler.master_weights.attach(inner_optimizer(opt))


# ---------------------------------------------------------------------- CPU FP16
def _cpu_context_factory(fp16_on_cpu: str) -> Callable[[], contextlib.AbstractContextManager]:
    """The FP16 compute context of a CPU run: the one branch between emulation and real autocast."""
    if fp16_on_cpu == "emulate":
        return _emulated_fp16
    return functools.partial(torch.autocast, "cpu", dtype=torch.float16)


@contextlib.contextmanager
def _emulated_fp16() -> Iterator[None]:
    """The emulation, with CPU autocast off inside it: a forward called under Accelerate's own
    `accelerator.autocast()` (torch's CPU FP16 autocast) is then emulated, not computed in real FP16
    on top of the emulation."""
    with torch.autocast("cpu", enabled=False), fp16_emulation("cuda"):
        yield


def _enable_cpu_fp16(accelerator: Accelerator, fp16_on_cpu: str) -> None:
    """Turn on FP16 compute on the CPU, where Accelerate leaves `native_amp` off."""
    context = _cpu_context_factory(fp16_on_cpu)
    install = accelerator.hf_lossscale
    install.fp16 = "emulated" if fp16_on_cpu == "emulate" else "native-cpu"
    install.context = context
    # `native_amp` gates Accelerate's unscaling before clipping (`unscale_gradients`), and makes its
    # own `autocast()` CPU FP16 autocast: all that native CPU FP16 needs of it.
    accelerator.native_amp = True
    for model in accelerator._models:
        _wrap_forward(accelerator.unwrap_model(model, keep_fp32_wrapper=True), context)
    if fp16_on_cpu == "emulate":
        # `accelerator.backward` calls `scaler.scale(loss).backward()`: the scaled loss runs its backward
        # under the emulation (gradient checkpointing recomputes the forward there)
        install.scaler._backward_context = context
    logger.warning(
        "hf_lossscale: FP16 on the CPU is %s (%s); figures from this run are not GPU measurements.",
        "EMULATED" if fp16_on_cpu == "emulate" else "native CPU autocast",
        "fp16_emulation(policy='cuda') in the prepared models' forward and in `accelerator.backward`; "
        "code of your own under `accelerator.autocast()` is torch's CPU FP16 autocast"
        if fp16_on_cpu == "emulate"
        else "torch.autocast('cpu', float16), ~20x slower",
    )


def _wrap_forward(model: torch.nn.Module, context: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Run `model.forward` under `context()` and return FP32 outputs, as Accelerate's prepare does."""
    if getattr(model, "_hf_lossscale_forward", False):
        return
    original = model.forward
    func = original.__func__ if hasattr(original, "__func__") else original

    @functools.wraps(func)
    def forward(*args, **kwargs):
        with context():
            return func(*args, **kwargs)

    model._original_forward = original
    converted = convert_outputs_to_fp32(forward)
    model.forward = MethodType(converted, model) if hasattr(original, "__func__") else converted
    model._hf_lossscale_forward = True


@contextlib.contextmanager
def plain_forward(model: torch.nn.Module):
    """Temporarily give a prepared model its own forward, without the FP16 wrapper that Accelerate
    (autocast) or `install_loss_scaler` (CPU FP16) put around it: for FP32 reference passes."""
    original = model.__dict__.get("_original_forward")
    wrapped = model.__dict__.get("forward")
    if original is None or wrapped is None:
        yield model
        return
    model.forward = original
    try:
        yield model
    finally:
        model.forward = wrapped


def _hook_prepare(accelerator: Accelerator) -> None:
    """Make models and optimizers prepared later pick up the CPU FP16 context and the scaler."""
    if accelerator.hf_lossscale.prepare_wrapped:
        return
    accelerator.hf_lossscale.prepare_wrapped = True
    prepare_model = accelerator.prepare_model
    prepare_optimizer = accelerator.prepare_optimizer

    @functools.wraps(prepare_model)
    def hooked_prepare_model(model, *args, **kwargs):
        on_cpu = accelerator.device.type == "cpu" and isinstance(accelerator.scaler, DynamicLossScaler)
        saved = accelerator.native_amp
        if on_cpu:
            accelerator.native_amp = False  # we wrap the forward ourselves, with the CPU context
        try:
            prepared = prepare_model(model, *args, **kwargs)
        finally:
            accelerator.native_amp = saved
        inner = accelerator.unwrap_model(prepared, keep_fp32_wrapper=True)
        context = fp16_context(accelerator)
        if on_cpu and context is not None:
            _wrap_forward(inner, context)
        if isinstance(accelerator.scaler, DynamicLossScaler):
            accelerator.scaler.set_parameter_names(inner)
            _apply_fp32_modules(inner, accelerator.scaler)
        return prepared

    @functools.wraps(prepare_optimizer)
    def hooked_prepare_optimizer(optimizer, *args, **kwargs):
        _refuse_fused_backward(optimizer)
        prepared = prepare_optimizer(optimizer, *args, **kwargs)
        if isinstance(accelerator.scaler, DynamicLossScaler):
            return _wrap_prepared_optimizer(accelerator, prepared, accelerator.scaler)
        return prepared

    accelerator.prepare_model = hooked_prepare_model
    accelerator.prepare_optimizer = hooked_prepare_optimizer


# ---------------------------------------------------------------------- clipping
_CLIP_ROUTED = (
    DistributedType.NO,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_CPU,
    DistributedType.FSDP,
)


def _route_clip(accelerator: Accelerator) -> None:
    """Send `accelerator.clip_grad_norm_` through `DynamicLossScaler.clip_grad_norm_` (unscale,
    overflow check and clip in one read of the gradients) where that gives Accelerate's result:
    the parameters with gradients are exactly those of one prepared optimizer, the run is FP16
    with our scaler, and it is not FSDP1 (whose wrapped module clips its own shards), DeepSpeed or
    XLA. Anything else goes to Accelerate's own method, unchanged."""
    if accelerator.hf_lossscale.clip_routed:
        return
    accelerator.hf_lossscale.clip_routed = True
    original = accelerator.clip_grad_norm_

    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        target = _single_optimizer_of(accelerator, parameters)
        if target is None:
            # a model held in FP16 steps on FP32 masters: Accelerate unscales (the FP16 gradients move
            # into the masters), then clips what it is given: the masters, not the emptied FP16 ones
            return original(_as_masters(accelerator, parameters), max_norm, norm_type=norm_type)
        scaler = accelerator.scaler
        for opt in accelerator._optimizers:  # Accelerate unscales every optimizer here
            inner = inner_optimizer(opt)
            if inner is not target:
                scaler.unscale_(inner)
        return scaler.clip_grad_norm_(target, max_norm, norm_type, parameters=parameters)

    accelerator.clip_grad_norm_ = clip_grad_norm_
    # (`accelerator.clip_grad_value_` needs nothing: Accelerate unscales, which moves a model held in FP16's
    # gradients into its masters, and the FP16 parameters' `.grad` then clips the masters' gradients)


def _single_optimizer_of(accelerator: Accelerator, parameters: list[torch.Tensor]) -> Any:
    """The prepared optimizer whose parameters with gradients are exactly `parameters`' (else None)."""
    scaler = accelerator.scaler
    if (
        not isinstance(scaler, DynamicLossScaler)
        or not scaler.is_enabled()
        or not (accelerator.native_amp and accelerator.mixed_precision == "fp16")
        or accelerator.distributed_type not in _CLIP_ROUTED
        or (accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2)
    ):
        return None
    matches = []
    for opt in accelerator._optimizers:
        inner = inner_optimizer(opt)
        # with master weights the optimizer holds FP32 masters, whose gradients are still in their FP16
        # parameters until the scaler reads them: compare through the pairs
        pairs = scaler.master_weights.pairs(inner)
        to_master = {id(h): m for h, m in pairs}
        half_of = {id(m): h for h, m in pairs}
        wanted = {id(to_master.get(id(p), p)) for p in parameters if p.grad is not None}
        owned = {
            id(p) for g in inner.param_groups for p in g["params"]
            if p.grad is not None or (id(p) in half_of and half_of[id(p)].grad is not None)
        }  # fmt: skip
        if owned == wanted:
            matches.append(inner)
    return matches[0] if len(matches) == 1 else None


def _as_masters(accelerator: Accelerator, parameters: list[torch.Tensor]) -> list[torch.Tensor]:
    """`parameters` with each FP16 parameter that has an FP32 master replaced by its master."""
    scaler = accelerator.scaler
    if not isinstance(scaler, DynamicLossScaler):
        return parameters
    to_master = {
        id(h): m
        for opt in accelerator._optimizers
        for h, m in scaler.master_weights.pairs(inner_optimizer(opt))
    }
    return [to_master.get(id(p), p) for p in parameters] if to_master else parameters
