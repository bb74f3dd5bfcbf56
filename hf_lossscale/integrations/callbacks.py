"""`TrainerCallback`s that watch an FP16 run: the event log, the overflow diagnosis, the flushed-fraction
probe and the activation-gradient probe. `LossScaleMixin` adds the ones its arguments ask for.

Each takes the trainer (as TRL's callbacks do) and reads only its public attributes (`args`, `state`,
`model`, `accelerator`, `compute_loss`, `is_world_process_zero`). The event log, the overflow
diagnosis and the flushed probe also work on a plain `Trainer` (with torch's `GradScaler`, or none):

```python
trainer = Trainer(model=model, args=args, train_dataset=train_dataset)
events = LossScaleEventLogCallback(trainer)
trainer.add_callback(events)
trainer.add_callback(OverflowDiagnosisCallback(trainer, events))
```
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from typing import Any

import torch
from transformers import TrainerCallback

from ..core.events import EVENT_LOG_NAME, EventSink, append_event
from ..core.overflow import display_origin, find_overflow_origin, rng_state
from ..core.scaler import DynamicLossScaler, LossScaleCollapseError
from ..core.scaler_observers import nonfinite_flags
from ..core.telemetry import ActivationGradientProbe, module_key
from ..fp16.emulation import measure_flushed_fraction
from ..fp16.fp32_modules import ancestors, fp32_module_names, run_in_fp32, runs_in_fp32
from ..masters.weights import gradient_of
from .accelerate_hook import effective_mixed_precision, fp16_context, fp16_kind, plain_forward

__all__ = [
    "ActivationProbeCallback",
    "TrainingBatchHook",
    "FlushedFractionCallback",
    "LossScaleEventLogCallback",
    "OverflowDiagnosisCallback",
    "PreflightCallback",
    "loss_scaler_of",
]

logger = logging.getLogger(__name__)


def loss_scaler_of(trainer: Any) -> DynamicLossScaler | None:
    """The trainer's `DynamicLossScaler`, if its Accelerator has one installed."""
    scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
    return scaler if isinstance(scaler, DynamicLossScaler) else None


class TrainingBatchHook:
    """A forward pre-hook on `model` that hands the inputs of each training forward (in train mode,
    with gradients on) to `receive(args, kwargs)`, `kwargs` without the Trainer's
    `num_items_in_batch` (it counts the whole accumulation window; a replay or probe of one
    micro-batch divides by `gradient_accumulation_steps` instead). `once=True` removes the hook
    after the first such forward. The inputs are the model's own references: no copy, no device work.
    """

    def __init__(self, model: torch.nn.Module, receive: Any, *, once: bool = False) -> None:
        self.receive = receive
        self.once = once
        self._handle: Any = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    @property
    def active(self) -> bool:
        return self._handle is not None

    def _hook(self, module, args, kwargs):
        if not module.training or not torch.is_grad_enabled():
            return
        if self.once:
            self.remove()
        self.receive(args, {k: v for k, v in kwargs.items() if k != "num_items_in_batch"})

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def _scale_in_force(trainer: Any) -> float | None:
    """The loss scale of an FP16 run (ours or torch's `GradScaler`; 1.0 with scaling off), or None
    when no scaler runs (FP32, BF16, DeepSpeed's own)."""
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is None:
        return None
    return scaler.get_scale() if scaler.is_enabled() else 1.0


class LossScaleEventLogCallback(TrainerCallback):
    """Writes the JSONL event log (`loss_scale_log.jsonl` in `output_dir`, see `hf_lossscale.core.events`):
    `run_start` at the start of training, `log` at every log, the scaler's observers' events after
    each step, `run_end` at the end. `record_error(err)` writes an `error` event
    (`LossScaleMixin.train` calls it; with a plain `Trainer`, call it from an `except` around
    `train()`). A resumed or repeated run appends: nothing is lost.

    It owns the run's `sink` (an `EventSink`): the other callbacks, given this one, emit their
    events into it, and it appends every event emitted there to the file; others (TensorBoard)
    subscribe to the same sink.

    Args:
        trainer: the `Trainer` whose run it logs.
        enabled (`bool`, *optional*, defaults to `True`): `False` writes nothing (the
            `loss_scale_event_log` argument).
    """

    def __init__(self, trainer: Any, enabled: bool = True) -> None:
        self.trainer = trainer
        self.enabled = enabled
        #: The run's events; every one emitted here is appended to the file.
        self.sink = EventSink()
        self.sink.subscribe(self._append)
        self._started = False  # run_start written for the current train() call

    @property
    def path(self) -> str | None:
        args = self.trainer.args
        if not self.enabled or args.output_dir is None or not self.trainer.is_world_process_zero():
            return None
        return os.path.join(args.output_dir, EVENT_LOG_NAME)

    def write(self, event: dict[str, Any]) -> None:
        """Emit an event that the sink need not keep (a log line, a per-step figure): the file and
        the sink's subscribers get it. Events others may read back go through `sink.emit`."""
        self.sink.emit(event, keep=False)

    def _append(self, event: dict[str, Any]) -> None:
        """Append one JSON line (on the main process only)."""
        path = self.path
        if path is None:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        append_event(path, event)

    def _start(self, resumed: bool) -> None:
        self._started = True
        self.write({"event": "run_start", "time": time.time(), "resumed": resumed, **run_info(self.trainer)})
        fix = getattr(self.trainer, "loss_normalisation", None)
        if fix is not None:
            self.write({**fix, "step": self.trainer.state.global_step})

    def on_train_begin(self, args, state, control, **kwargs):
        self._start(resumed=state.global_step > 0)  # a resumed run starts from its checkpoint's step

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.write({"event": "log", **state.log_history[-1]})

    def on_step_end(self, args, state, control, **kwargs):
        scaler = loss_scaler_of(self.trainer)
        if scaler is not None:
            for event in scaler.drain_events():
                self.sink.emit({**event, "step": state.global_step})

    def on_train_end(self, args, state, control, **kwargs):
        end: dict[str, Any] = {"event": "run_end", "step": state.global_step, "time": time.time()}
        scaler = loss_scaler_of(self.trainer)
        if scaler is not None:
            end.update(scaler.stats())
        self.sink.emit(end)
        self._started = False

    def record_error(self, err: BaseException, resumed: bool = False) -> None:
        """Write the exception that stopped `train()` (after a `run_start`, if training never began:
        e.g. a checkpoint that could not be loaded)."""
        if not self._started:
            self._start(resumed)
        self.sink.emit(
            {
                "event": "error",
                "step": self.trainer.state.global_step,
                "type": type(err).__name__,
                "collapse": isinstance(err, LossScaleCollapseError),
                "message": str(err)[:2000],
            }
        )
        self._started = False


def telemetry_events(snapshots: dict[str, dict[str, Any] | None], log_step: int) -> list[dict[str, Any]]:
    """The `telemetry` events for the snapshots a training log read (`param_grads`, `activation_grads`).

    A parameter-gradient snapshot's `step` is the optimizer step it was measured at (its
    `global_step`, which `LossScaleMixin.log` works out), `log_step` the log that read it; the
    snapshot's own `step`, the scaler's iteration, becomes `scale_step`. The activation figures are
    summed over the probed steps since the previous log."""
    out = []
    grads, acts = snapshots.get("param_grads"), snapshots.get("activation_grads")
    if grads is not None:
        out.append({**grads, "event": "telemetry", "step": grads.get("global_step", log_step),
                    "log_step": log_step, "source": "param_grads", "scale_step": grads["step"]})  # fmt: skip
    if acts is not None:
        out.append({"event": "telemetry", "step": log_step, "log_step": log_step,
                    "source": "activation_grads", **acts})  # fmt: skip
    return out


def run_info(trainer: Any) -> dict[str, Any]:
    """The `run_start` fields: precision, loss-scale config, sizes, seed and versions."""
    import accelerate
    import transformers

    from .. import __version__
    from ..tools.bf16 import cpu_name

    scaler = loss_scaler_of(trainer)
    args = trainer.args
    extra = trainer.loss_scale_run_info() if hasattr(trainer, "loss_scale_run_info") else {}
    return {
        **extra,
        "mixed_precision": effective_mixed_precision(trainer.accelerator),
        # "emulated", "native-cpu", "cuda"; None when no DynamicLossScaler runs
        "fp16": fp16_kind(trainer.accelerator) if scaler else None,
        "loss_scale_config": scaler.config.to_dict() if scaler else None,
        # the modules that run in FP32 at the start (configured, the model's own, a resumed "auto")
        "fp32_modules": fp32_module_names(trainer.accelerator.unwrap_model(trainer.model)) if scaler else [],
        # the dtypes the model's trainable weights are held in (elements per dtype): FP16 weights show here
        "trainable_param_dtypes": trainable_dtypes(trainer.model),
        # the machine behind the run's timings: the CPU's model name and cores, and the GPU if one ran
        "processor": cpu_name(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "world_size": args.world_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "max_steps": args.max_steps,
        "seed": args.seed,
        "versions": {
            "hf_lossscale": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "accelerate": accelerate.__version__,
        },
    }


def trainable_dtypes(model: Any) -> dict[str, int]:
    """Elements of the trainable parameters per dtype, e.g. `{"torch.float16": 22713216}`."""
    counts: dict[str, int] = {}
    for p in model.parameters():
        if p.requires_grad:
            counts[str(p.dtype)] = counts.get(str(p.dtype), 0) + p.numel()
    return counts


class OverflowDiagnosisCallback(TrainerCallback):
    """On a skipped optimizer step, while the gradients still exist: say which kind of overflow it
    was and where it starts, name the parameters with non-finite gradients, and (with
    `fp32_modules="auto"`) run a forward overflow's origin in FP32 from the next step on. An
    `overflow` event (`kind`, `origin`, `module_type`, `loss_nonfinite`, `params`, ...) and a warning
    that leads with the origin.

    - `kind` `"forward"`: the loss was non-finite; `origin` is the first module, in execution order,
      whose output is non-finite while its inputs are finite. No loss scale can fix it.
    - `kind` `"backward"`: the loss was finite; `origin` is the first module, in backward order, whose
      input gradient is non-finite while its output gradient is finite, at the step's scale.

    Costs nothing on clean steps beyond keeping references to the micro-batches of the current
    optimizer step and a host copy of the random generators' state (a forward pre-hook; no device
    work), so that a replay draws the step's own dropout masks. On a skipped step (the first
    `max_diagnoses` of a run, plus every one `"auto"` can still act on) it replays those micro-batches
    with hooks on every module: one forward per micro-batch up to the one that overflows, and for a
    finite loss one backward that writes no `.grad` (`hf_lossscale.core.overflow`). A backward overflow is
    replayed only for the first `max_backward_replays` of a run: its fix, the backoff, is already made,
    and the replay of a backward pass with hooks costs a few training steps; later ones are named by
    their parameters only. With a plain
    `Trainer` (torch's `GradScaler`) the loss flag comes from the model's output `loss`.
    """

    def __init__(
        self,
        trainer: Any,
        event_log: LossScaleEventLogCallback | None = None,
        max_diagnoses: int = 5,
        max_backward_replays: int = 1,
    ):
        self.trainer = trainer
        self.event_log = event_log
        self.max_diagnoses = max_diagnoses
        self.max_backward_replays = max_backward_replays
        self.diagnosed = 0
        self.backward_replays = 0
        #: Where its events go: the event log's sink when given one (so the file gets them too).
        self.sink = event_log.sink if event_log is not None else EventSink()
        self._loss_nonfinite: torch.Tensor | None = None
        self._batches: list[tuple[tuple, dict]] = []
        self._rng_states: list[dict[str, Any]] = []
        self._replaying = False  # the replay's own forwards are not batches to keep
        self._step_scale_seen: torch.Tensor | None = None
        self._replay_error: str | None = None
        self._handles: list[Any] = []
        self._model: torch.nn.Module | None = None

    @property
    def events(self) -> list[dict[str, Any]]:
        """Its events so far (`overflow`, `fp32_module_added`, `fp32_module_refused`), from the sink."""
        return self.sink.of("overflow", "fp32_module_added", "fp32_module_refused")

    def _watch_loss(self, module, args, output):
        loss = output.get("loss") if isinstance(output, dict) else None
        if module.training and isinstance(loss, torch.Tensor):
            bad = ~torch.isfinite(loss.detach()).all()
            self._loss_nonfinite = bad if self._loss_nonfinite is None else self._loss_nonfinite | bad

    def _take_batch(self, args, kwargs):
        if not self._replaying:
            # references, and the generators' state (a host copy): replayed, with the same dropout
            # masks, if the step is skipped
            if not self._batches:  # the step's scale, as its first forward saw it (one copy, no sync)
                scaler = getattr(self.trainer.accelerator, "scaler", None)
                own = getattr(scaler, "_scale", None)
                self._step_scale_seen = own.detach().clone() if isinstance(own, torch.Tensor) else None
            self._batches.append((args, kwargs))
            self._rng_states.append(rng_state(self._model))

    def on_train_begin(self, args, state, control, **kwargs):
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        if not self._handles and scaler is not None and scaler.is_enabled():
            model = self._model = self.trainer.accelerator.unwrap_model(self.trainer.model)
            self._handles = [
                TrainingBatchHook(model, self._take_batch),
                model.register_forward_hook(self._watch_loss),
            ]

    def on_step_begin(self, args, state, control, **kwargs):
        self._batches, self._rng_states = [], []

    def on_train_end(self, args, state, control, **kwargs):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._batches, self._rng_states = [], []

    def _step_scale(self, scaler: Any) -> float:
        """The scale the skipped step ran at (its update may have backed off since): the copy taken at
        its first forward; without one, the scale now, undone by the backoff (wrong at the floor, where
        the clamp left the scale as it was)."""
        if self._step_scale_seen is not None:
            return float(self._step_scale_seen.item())
        scale = scaler.get_scale()
        if isinstance(scaler, DynamicLossScaler):
            backed = scaler.last_backed_off
            return (
                scale / scaler.config.backoff_factor if backed is not None and bool(backed.item()) else scale
            )
        return scale / scaler.get_backoff_factor()  # torch's GradScaler backs off on every skip

    def on_optimizer_step(self, args, state, control, **kwargs):
        flag, self._loss_nonfinite = self._loss_nonfinite, None
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return
        if not self.trainer.accelerator.optimizer_step_was_skipped:  # read once per step by the Trainer too
            return
        ours = scaler if isinstance(scaler, DynamicLossScaler) else None
        auto = ours is not None and ours.config.auto_fp32
        if self.diagnosed >= self.max_diagnoses and not auto:
            return
        self.diagnosed += 1
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        named = [(n, g) for n, p in model.named_parameters() if (g := gradient_of(p)) is not None]
        bad = nonfinite_flags([g for _, g in named]).tolist() if named else []
        params = [n for (n, _), b in zip(named, bad, strict=True) if b]
        if ours is not None and ours.last_loss_nonfinite is not None:
            loss_nonfinite = bool(ours.last_loss_nonfinite.item())
        else:
            loss_nonfinite = bool(flag.item()) if flag is not None else None
        # A backward overflow's fix is the backoff the scaler already made: only the first of a run is
        # replayed to name its origin (a replay of a backward pass costs a few training steps).
        replay = loss_nonfinite is not False or self.backward_replays < self.max_backward_replays
        if replay and loss_nonfinite is False:
            self.backward_replays += 1
        self._replay_error = None
        origin = self._diagnose(model, scaler) if replay else None
        if self._replay_error is not None and loss_nonfinite is False:
            self.backward_replays -= 1  # a replay that could not run spent nothing: the next one may
        event = {
            "event": "overflow",
            "step": state.global_step + 1,  # the optimizer step being skipped
            "kind": origin["kind"] if origin else ("forward" if loss_nonfinite else "backward"),
            "origin": origin["origin"] if origin else None,
            "module_type": origin["module_type"] if origin else None,
            "loss_scale_after": scaler.get_scale(),
            "loss_nonfinite": loss_nonfinite,
            "modules": sorted({module_key(n) for n in params}),
            "params": params[:20],
            "n_params": len(params),
        }
        if origin is None:
            event["diagnosis"] = (
                f"replay failed: {self._replay_error}"
                if self._replay_error is not None
                else "not reproduced in a replay of the step's batches (transient)"
                if replay
                else f"not replayed (only the first {self.max_backward_replays} backward overflow(s) of a run are)"
            )
        if ours is not None and origin is not None:
            ours.overflow_origin = {"step": event["step"], **origin}
        self._write(event)
        logger.warning("hf_lossscale: step %d skipped: %s", event["step"], _describe(event))
        if auto and event["kind"] == "forward" and origin is not None:
            self._move_to_fp32(ours, model, origin["origin"], event["step"])

    def _diagnose(self, model: torch.nn.Module, scaler: Any) -> dict[str, Any] | None:
        if not self._batches:
            return None
        context = fp16_context(self.trainer.accelerator) or contextlib.nullcontext

        def loss_fn(m, batch):
            args, inputs = batch
            if args:
                out = m(*args, **inputs)
                return out["loss"] if isinstance(out, dict) else out[0]
            return self.trainer.compute_loss(m, inputs)

        self._replaying = True  # else each replayed forward would add a batch to the list being replayed
        try:
            return find_overflow_origin(
                model, list(self._batches), loss_fn, context=context, scale=self._step_scale(scaler),
                rng_states=list(self._rng_states),
            )  # fmt: skip
        except Exception as err:  # noqa: BLE001 - a diagnosis must never stop training
            self._replay_error = f"{type(err).__name__}: {err}"[:300]
            logger.warning("hf_lossscale: the overflow diagnosis failed (%s)", self._replay_error)
            return None
        finally:
            self._replaying = False

    def _move_to_fp32(
        self, scaler: DynamicLossScaler, model: torch.nn.Module, origin: str, step: int
    ) -> None:
        moved = scaler.state.fp32_modules
        if origin == "":
            self._write({"event": "fp32_module_refused", "step": step, "module": origin,
                         "reason": "the model's own forward (a loss or head computed outside submodules)"})  # fmt: skip
            logger.warning("hf_lossscale: fp32_modules='auto': the forward overflow starts in the model's own "
                           "forward, outside its submodules; nothing to move to FP32.")  # fmt: skip
            return
        if origin in moved:
            return
        named = dict(model.named_modules())
        if origin in named and any(
            runs_in_fp32(named[n]) for n in (origin, *ancestors(origin)) if n in named
        ):
            # configured, or the model's own `_keep_in_fp32_modules`: it runs in FP32 already, so the
            # overflow is in its FP32 output or after it; moving it again would change nothing
            self._write({"event": "fp32_module_refused", "step": step, "module": origin,
                         "reason": "it runs in FP32 already"})  # fmt: skip
            logger.warning("hf_lossscale: fp32_modules='auto': `%s` overflowed but runs in FP32 already; "
                           "nothing to move.", origin)  # fmt: skip
            return
        cap = scaler.config.max_auto_fp32_modules
        if len(moved) >= cap:
            self._write({"event": "fp32_module_refused", "step": step, "module": origin,
                         "reason": f"max_auto_fp32_modules={cap} reached", "fp32_modules": list(moved)})  # fmt: skip
            warnings.warn(
                f"hf_lossscale: fp32_modules='auto' would move `{origin}` to FP32, but max_auto_fp32_modules="
                f"{cap} modules are there already ({moved}). Raise the cap, or list modules by hand.",
                stacklevel=2,
            )
            return
        run_in_fp32(model, [origin], include_model_own=False)
        moved.append(origin)
        self._write(
            {"event": "fp32_module_added", "step": step, "module": origin, "fp32_modules": list(moved)}
        )
        warnings.warn(
            f"hf_lossscale: fp32_modules='auto': `{origin}` overflowed in the FP16 forward; it runs in FP32 "
            f"from step {step + 1} on ({len(moved)} of at most {scaler.config.max_auto_fp32_modules}).",
            stacklevel=2,
        )

    def _write(self, event: dict[str, Any]) -> None:
        self.sink.emit(event)


def _describe(event: dict[str, Any]) -> str:
    """The warning's text: the origin first, the parameters as detail."""
    where = ", ".join(event["modules"][:5]) or "(none found: a fused kernel may have consumed them)"
    if event["kind"] == "forward":
        lead = (
            f"FORWARD overflow in {display_origin(event['origin'])} ({event['module_type']}): its output is non-finite in "
            "FP16 with finite inputs, so the loss is non-finite and no loss scale can help; run it in FP32 "
            "(fp32_modules, or 'auto')"
            if event["origin"] is not None
            else "the loss itself was non-finite (a forward overflow; no module to blame was found)"
        )
    elif event["origin"] is not None:
        lead = f"backward overflow starting in {display_origin(event['origin'])} ({event['module_type']}) at this scale"
    else:
        lead = "non-finite gradients"
    return f"{lead}; non-finite gradients in {where}"


class FlushedFractionCallback(TrainerCallback):
    """`measure_flushed_fraction` on the first training batch, at the scale in force: at the start
    (inside the first training forward, before any gradient exists) and at the end of training; a
    `flushed_probe` event each time. Only in FP16 runs with a loss scaler (ours or torch's).

    The batch is the one the model receives (a forward pre-hook takes it), so the data order is
    untouched; the probe runs in eval mode (no dropout), so it draws no random numbers.
    """

    def __init__(self, trainer: Any, event_log: LossScaleEventLogCallback | None = None) -> None:
        self.trainer = trainer
        self.event_log = event_log
        #: Where its `flushed_probe` events go: the event log's sink when given one.
        self.sink = event_log.sink if event_log is not None else EventSink()
        self.batch: dict[str, Any] | None = None
        self._hook: TrainingBatchHook | None = None

    @property
    def results(self) -> list[dict[str, Any]]:
        """Its `flushed_probe` events so far, from the sink."""
        return self.sink.of("flushed_probe")

    def on_train_begin(self, args, state, control, **kwargs):
        if (
            self.batch is None
            and self._hook is None
            and getattr(self.trainer.accelerator, "scaler", None) is not None
        ):
            self._hook = TrainingBatchHook(self.trainer.model, self._take_batch, once=True)

    def _take_batch(self, args, kwargs):
        self._hook = None
        # The probe divides one micro-batch's mean loss by gradient_accumulation_steps, as the step does.
        self.batch = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}
        self.measure("start")

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.batch is not None:
            self.measure("end")

    def measure(self, when: str) -> dict[str, Any]:
        trainer = self.trainer
        kind = fp16_kind(trainer.accelerator) or "cuda"
        fp16, policy = {"emulated": ("emulate", "cuda"), "native-cpu": ("native", "cpu")}.get(
            kind, ("native", "cuda")
        )
        model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=True)
        with plain_forward(model):
            result = measure_flushed_fraction(
                model,
                self.batch,
                fp16=fp16,
                policy=policy,
                scale=_scale_in_force(trainer) or 1.0,
                loss_divisor=trainer.args.gradient_accumulation_steps,
                loss_fn=lambda m, b: trainer.compute_loss(m, b),
            )
        result.pop("reference")
        self.sink.emit({"event": "flushed_probe", "when": when, "step": trainer.state.global_step, **result})
        return result


class PreflightCallback(TrainerCallback):
    """`loss_scale_preflight`: `hf_lossscale.fp16.preflight` on the first training batch, before the first
    step (inside the first training forward, as the flushed probe takes its batch): a `preflight`
    event, and a warning with its table when a module overflows, comes near, or the FP16 replay finds
    an origin (otherwise the table is logged at INFO). The FP32 passes run in eval mode and the replay
    forks the RNG, so the run's data order and dropout are untouched; the model is left as found."""

    def __init__(self, trainer: Any, event_log: LossScaleEventLogCallback | None = None) -> None:
        self.trainer = trainer
        self.event_log = event_log
        #: Where its `preflight` event goes: the event log's sink when given one.
        self.sink = event_log.sink if event_log is not None else EventSink()
        #: The last pre-flight's full figures (`preflight()`'s result; the event summarises them).
        self.result: dict[str, Any] | None = None
        self._hook: TrainingBatchHook | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.result is None and self._hook is None and getattr(self.trainer.accelerator, "scaler", None):
            self._hook = TrainingBatchHook(self.trainer.model, self._take_batch, once=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _take_batch(self, args, kwargs):
        self._hook = None
        self.run(kwargs)

    def run(self, batch: dict[str, Any]) -> dict[str, Any]:
        from ..fp16.preflight import format_preflight, preflight

        trainer = self.trainer
        model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=True)
        context = fp16_context(trainer.accelerator)
        with plain_forward(model):
            result = preflight(
                model, [batch], lambda m, b: trainer.compute_loss(m, b), fp16_context=context,
                loss_divisor=trainer.args.gradient_accumulation_steps,
            )  # fmt: skip
        self.result = result
        table = format_preflight(result)
        modules = result["modules"]
        event = {
            "event": "preflight",
            "step": trainer.state.global_step,
            "overflowing_modules": [n for n, m in modules.items() if m["status"] == "overflows"],
            "near_modules": [n for n, m in modules.items() if m["status"] == "near"],
            "fp16_origins": [o.get("origin") for o in result["overflow_in_fp16"]],
            "suggested_fp32_modules": result["suggested_fp32_modules"],
            "suggested_init_scale": result["suggested_init_scale"],
        }
        self.sink.emit(event)
        if event["overflowing_modules"] or event["near_modules"] or event["fp16_origins"]:
            warnings.warn(f"hf_lossscale pre-flight (FP32 passes on the first batch):\n{table}", stacklevel=2)
        else:
            logger.info("hf_lossscale pre-flight (FP32 passes on the first batch):\n%s", table)
        return result


class ActivationProbeCallback(TrainerCallback):
    """Turns an `ActivationGradientProbe` on for the optimizer steps on which the trainer's
    `DynamicLossScaler` takes telemetry (every `telemetry_interval`), so both snapshots describe
    the same steps. `read()` gives the figures since the last read (the mixin logs them)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.probe: ActivationGradientProbe | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        scaler = loss_scaler_of(self.trainer)
        if scaler is None:
            return
        if self.probe is None:
            self.probe = ActivationGradientProbe(self.trainer.accelerator.unwrap_model(self.trainer.model))
        self.probe.active = scaler.telemetry.due(scaler.iteration)

    def read(self) -> dict[str, Any] | None:
        """The figures since the last read (one host sync), or None if nothing was recorded."""
        return self.probe.read() if self.probe is not None and self.probe.counts else None
