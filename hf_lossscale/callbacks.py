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

import json
import logging
import os
import time
from typing import Any

import torch
from transformers import TrainerCallback

from .accelerate_hook import effective_mixed_precision, plain_forward
from .emulation import measure_flushed_fraction
from .events import EVENT_LOG_NAME
from .scaler import DynamicLossScaler, LossScaleCollapseError
from .telemetry import ActivationGradientProbe, module_key

__all__ = [
    "ActivationProbeCallback",
    "FlushedFractionCallback",
    "LossScaleEventLogCallback",
    "OverflowDiagnosisCallback",
    "loss_scaler_of",
]

logger = logging.getLogger(__name__)


def loss_scaler_of(trainer: Any) -> DynamicLossScaler | None:
    """The trainer's `DynamicLossScaler`, if its Accelerator has one installed."""
    scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
    return scaler if isinstance(scaler, DynamicLossScaler) else None


def _scale_in_force(trainer: Any) -> float | None:
    """The loss scale of an FP16 run (ours or torch's `GradScaler`; 1.0 with scaling off), or None
    when no scaler runs (FP32, BF16, DeepSpeed's own)."""
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is None:
        return None
    return scaler.get_scale() if scaler.is_enabled() else 1.0


class LossScaleEventLogCallback(TrainerCallback):
    """Writes the JSONL event log (`loss_scale_log.jsonl` in `output_dir`, see `hf_lossscale.events`):
    `run_start` at the start of training, `log` (and `telemetry`) at every log, `run_end` at the end.
    Other callbacks write their events through `write`. `record_error(err)` writes an `error` event
    (`LossScaleMixin.train` calls it; with a plain `Trainer`, call it from an `except` around
    `train()`). A resumed or repeated run appends: nothing is lost.

    Args:
        trainer: the `Trainer` whose run it logs.
        enabled (`bool`, *optional*, defaults to `True`): `False` writes nothing (the
            `loss_scale_event_log` argument).
    """

    def __init__(self, trainer: Any, enabled: bool = True) -> None:
        self.trainer = trainer
        self.enabled = enabled
        self._started = False  # run_start written for the current train() call

    @property
    def path(self) -> str | None:
        args = self.trainer.args
        if not self.enabled or args.output_dir is None or not self.trainer.is_world_process_zero():
            return None
        return os.path.join(args.output_dir, EVENT_LOG_NAME)

    def write(self, event: dict[str, Any]) -> None:
        """Append one JSON line (on the main process only)."""
        path = self.path
        if path is None:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")

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
        snapshots = getattr(self.trainer, "latest_telemetry", None) or {}
        grads, acts = snapshots.get("param_grads"), snapshots.get("activation_grads")
        if grads is not None:
            # `step` is the log step (the snapshot's own `step`, the scaler's iteration, is `scale_step`).
            self.write({**grads, "event": "telemetry", "step": state.global_step, "source": "param_grads",
                        "scale_step": grads["step"]})  # fmt: skip
        if acts is not None:
            self.write(
                {"event": "telemetry", "step": state.global_step, "source": "activation_grads", **acts}
            )

    def on_train_end(self, args, state, control, **kwargs):
        end: dict[str, Any] = {"event": "run_end", "step": state.global_step, "time": time.time()}
        scaler = loss_scaler_of(self.trainer)
        if scaler is not None:
            end.update(scaler.stats())
        self.write(end)
        self._started = False

    def record_error(self, err: BaseException, resumed: bool = False) -> None:
        """Write the exception that stopped `train()` (after a `run_start`, if training never began:
        e.g. a checkpoint that could not be loaded)."""
        if not self._started:
            self._start(resumed)
        self.write(
            {
                "event": "error",
                "step": self.trainer.state.global_step,
                "type": type(err).__name__,
                "collapse": isinstance(err, LossScaleCollapseError),
                "message": str(err)[:2000],
            }
        )
        self._started = False


def run_info(trainer: Any) -> dict[str, Any]:
    """The `run_start` fields: precision, loss-scale config, sizes, seed and versions."""
    import accelerate
    import transformers

    from . import __version__

    scaler = loss_scaler_of(trainer)
    args = trainer.args
    return {
        "mixed_precision": effective_mixed_precision(trainer.accelerator),
        # "emulated", "native-cpu", "cuda"; None when no DynamicLossScaler runs
        "fp16": getattr(trainer.accelerator, "hf_lossscale_fp16", None) if scaler else None,
        "loss_scale_config": scaler.config.to_dict() if scaler else None,
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


class OverflowDiagnosisCallback(TrainerCallback):
    """On a skipped optimizer step (the first `max_diagnoses` of a run), while the gradients still
    exist: name the parameters and modules whose gradients were non-finite, and say whether the
    model's own loss (its output's `loss`) already was; an `overflow` event and a warning.

    Costs nothing on clean steps: one device flag per forward (no sync), read only on a skipped
    step. `loss_nonfinite` is None when the model's output carries no `loss` (a loss computed
    outside the model).
    """

    def __init__(
        self, trainer: Any, event_log: LossScaleEventLogCallback | None = None, max_diagnoses: int = 5
    ):
        self.trainer = trainer
        self.event_log = event_log
        self.max_diagnoses = max_diagnoses
        self.diagnosed = 0
        self._loss_nonfinite: torch.Tensor | None = None
        self._handle: Any = None

    def _watch_loss(self, module, args, output):
        loss = output.get("loss") if isinstance(output, dict) else None
        if module.training and isinstance(loss, torch.Tensor):
            bad = ~torch.isfinite(loss.detach()).all()
            self._loss_nonfinite = bad if self._loss_nonfinite is None else self._loss_nonfinite | bad

    def on_train_begin(self, args, state, control, **kwargs):
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        if self._handle is None and scaler is not None and scaler.is_enabled():
            model = self.trainer.accelerator.unwrap_model(self.trainer.model)
            self._handle = model.register_forward_hook(self._watch_loss)

    def on_train_end(self, args, state, control, **kwargs):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def on_optimizer_step(self, args, state, control, **kwargs):
        flag, self._loss_nonfinite = self._loss_nonfinite, None
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        if scaler is None or not scaler.is_enabled() or self.diagnosed >= self.max_diagnoses:
            return
        if not self.trainer.accelerator.optimizer_step_was_skipped:  # read once per step by the Trainer too
            return
        self.diagnosed += 1
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        with torch.no_grad():
            bad = torch.stack([~torch.isfinite(g).all() for _, g in named]).tolist() if named else []
        params = [n for (n, _), b in zip(named, bad, strict=True) if b]
        event = {
            "event": "overflow",
            "step": state.global_step + 1,  # the optimizer step being skipped
            "loss_scale_after": scaler.get_scale(),
            "loss_nonfinite": bool(flag.item()) if flag is not None else None,
            "modules": sorted({module_key(n) for n in params}),
            "params": params[:20],
            "n_params": len(params),
        }
        if self.event_log is not None:
            self.event_log.write(event)
        logger.warning(
            "hf_lossscale: step %d skipped: non-finite gradients in %s%s",
            event["step"],
            ", ".join(event["modules"][:5]) or "(none found: a fused kernel may have consumed them)",
            "; the loss itself was non-finite" if event["loss_nonfinite"] else "",
        )


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
        self.batch: dict[str, Any] | None = None
        self.results: list[dict[str, Any]] = []
        self._handle: Any = None

    def on_train_begin(self, args, state, control, **kwargs):
        if (
            self.batch is None
            and self._handle is None
            and getattr(self.trainer.accelerator, "scaler", None) is not None
        ):
            self._handle = self.trainer.model.register_forward_pre_hook(self._take_batch, with_kwargs=True)

    def _take_batch(self, module, args, kwargs):
        if not module.training or not torch.is_grad_enabled():
            return
        self._handle.remove()
        self._handle = None
        # The Trainer passes num_items_in_batch for the whole accumulation window; the probe divides
        # one micro-batch's mean loss by gradient_accumulation_steps instead, as the step does.
        self.batch = {
            k: v.detach().clone() if torch.is_tensor(v) else v
            for k, v in kwargs.items()
            if k != "num_items_in_batch"
        }
        self.measure("start")

    def on_train_end(self, args, state, control, **kwargs):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.batch is not None:
            self.measure("end")

    def measure(self, when: str) -> dict[str, Any]:
        trainer = self.trainer
        kind = getattr(trainer.accelerator, "hf_lossscale_fp16", "cuda")
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
        event = {"event": "flushed_probe", "when": when, "step": trainer.state.global_step, **result}
        self.results.append(event)
        if self.event_log is not None:
            self.event_log.write(event)
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
