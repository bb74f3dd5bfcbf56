"""Trainer integration: `LossScaleMixin` and `LossScaleTrainer` (their arguments:
`hf_lossscale.integrations.training_args`)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import warnings
from typing import Any

import torch
from accelerate.utils import DistributedType
from transformers import Trainer
from transformers.trainer import SCALER_NAME, TRAINER_STATE_NAME

from ..core.config import LossScaleConfig, resolve_config
from ..core.events import strict_json
from ..core.scaler import DynamicLossScaler
from ..fp16.fp32_modules import run_in_fp32
from ..fp16.half_products import fp16_products
from ..masters.optimizer_wrappers import inner_optimizer
from .accelerate_hook import effective_mixed_precision, fp16_kind, install_loss_scaler
from .callbacks import (
    ActivationProbeCallback,
    FlushedFractionCallback,
    LossScaleEventLogCallback,
    OverflowDiagnosisCallback,
    PreflightCallback,
    telemetry_events,
)
from .deepspeed import to_deepspeed_config
from .loss_normalisation import fix_loss_normalisation
from .resume import LOAD_CONFIG_WARNINGS, restore_settings, resume_line
from .training_args import ARG_TO_FIELD, LossScaleTrainingArguments

__all__ = ["LossScaleMixin", "LossScaleTrainer", "last_complete_checkpoint"]

logger = logging.getLogger(__name__)

_FRESH_HINT = (
    "To start a fresh loss scaler on purpose (initial scale, counters at zero), pass "
    "`--loss_scale_fresh_on_resume` (LossScaleTrainingArguments) or "
    "`LossScaleTrainer(..., loss_scale_fresh_on_resume=True)`."
)


#: Why TRL's `AsyncGRPOTrainer` is refused under a loss scaler (docs/rl.md, "AsyncGRPO"): here and in
#: `FP16AsyncGRPOTrainer`.
ASYNC_GRPO_REFUSAL = (
    "its vLLM weight sync and model version would advance on a skipped FP16 step, and its packed loss "
    "bypasses the mismatch measurement. Use FP16GRPOTrainer (use_vllm=True for a vLLM sampler), or "
    "AsyncGRPOTrainer without fp16=True"
)


def _async_grpo_base(cls: type) -> type | None:
    """TRL's `AsyncGRPOTrainer` among `cls`'s bases, recognised by its module (TRL is not imported)."""
    return next(
        (
            c
            for c in cls.__mro__
            if c.__name__ == "AsyncGRPOTrainer" and c.__module__.startswith("trl.experimental.async_grpo")
        ),
        None,
    )


_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def _checkpoint_problem(path: str, step: int) -> str | None:
    """Why `path` is not a complete Trainer checkpoint, or None. The Trainer writes
    `trainer_state.json` last, so a checkpoint cut short by a crash lacks it or holds a partial one."""
    state_file = os.path.join(path, TRAINER_STATE_NAME)
    try:
        with open(state_file, encoding="utf-8") as f:
            state = json.load(f)
    except FileNotFoundError:
        return f"no {TRAINER_STATE_NAME} (written last: the save was cut short)"
    except (OSError, ValueError) as err:
        return f"unreadable {TRAINER_STATE_NAME}: {err}"
    if not isinstance(state, dict) or state.get("global_step") != step:
        return f"{TRAINER_STATE_NAME} does not describe step {step}"
    return None


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The highest-numbered complete `checkpoint-N` in `output_dir`, or None.

    `transformers.trainer_utils.get_last_checkpoint` takes the highest number whether or not its
    save finished; this skips (with a warning naming it, and without deleting anything) any
    checkpoint whose `trainer_state.json`, the file the Trainer writes last, is missing or broken.
    """
    if not os.path.isdir(output_dir):
        return None
    found = sorted(
        ((int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))),
        reverse=True,
    )
    for step, name in found:
        path = os.path.join(output_dir, name)
        if not os.path.isdir(path):
            continue
        problem = _checkpoint_problem(path, step)
        if problem is None:
            return path
        warnings.warn(f"Skipping incomplete checkpoint {path}: {problem}.", stacklevel=2)
    return None


def check_deepspeed_fp16(config: LossScaleConfig, fp16_section: dict[str, Any]) -> list[str]:
    """Warn, naming them, where DeepSpeed's `fp16` section differs from `to_deepspeed_config(config)`
    ("auto" values, which Accelerate fills in, count as agreeing). Returns the differing keys."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the inexpressible settings are not the question here
        wanted = to_deepspeed_config(config)
    differing = sorted(
        k for k, v in wanted.items() if k in fp16_section and fp16_section[k] not in (v, "auto")
    )
    missing = sorted(k for k in wanted if k not in fp16_section)
    if differing or missing:
        warnings.warn(
            "DeepSpeed owns the loss scaler in this run; its fp16 section differs from the loss-scale config: "
            + ", ".join(f"{k}={fp16_section[k]!r} (config: {wanted[k]!r})" for k in differing)
            + (f"; not set there (DeepSpeed defaults apply): {missing}" if missing else "")
            + ". Put `hf_lossscale.integrations.deepspeed.to_deepspeed_config(config)` in its fp16 section.",
            stacklevel=3,
        )
    return differing + missing


def _refuse_setting_keywords(kwargs: dict[str, Any], args_given: Any) -> None:
    """`LossScaleTrainer(..., loss_scale_init=...)`: a `LossScaleTrainingArguments` field given to the
    trainer. Refused with the two ways that work (the Trainer's own error names neither)."""
    given = [k for k in kwargs if k.startswith("loss_scale_")]
    if not given:
        return
    known = [k for k in given if k in ARG_TO_FIELD]
    config = ", ".join(f"{ARG_TO_FIELD[k]}={kwargs[k]!r}" for k in known) or "..."
    fields = ", ".join(f"{k}={kwargs[k]!r}" for k in known) or "..."
    plain = args_given is not None and not isinstance(args_given, LossScaleTrainingArguments)
    unknown = sorted(set(given) - set(known))
    raise TypeError(
        f"LossScaleTrainer got {', '.join(given)} as keyword argument(s): "
        + (f"{unknown} are not loss-scale settings ({sorted(ARG_TO_FIELD)} are). " if unknown else "")
        + "The settings are fields of `LossScaleTrainingArguments`, not of the trainer"
        + (" (these args are plain `TrainingArguments`)" if plain else "")
        + f". Either pass `args=LossScaleTrainingArguments(..., {fields})`, or keep your "
        f"TrainingArguments and pass `loss_scale_config=LossScaleConfig({config})`."
    )


def _is_training_log(logs: dict[str, Any]) -> bool:
    """A training log (the Trainer's `loss` every `logging_steps`), not an evaluation's metrics
    (`eval_loss`, `<prefix>_runtime`) nor the end-of-training summary (`train_loss`, `train_runtime`)."""
    return "loss" in logs and not any(k.endswith("_runtime") for k in logs)


def deepspeed_scale_figures(engine: Any) -> dict[str, float]:
    """`loss_scale` and `skipped_steps` of a DeepSpeed engine, under our log names (empty if absent)."""
    out: dict[str, float] = {}
    optimizer = getattr(engine, "optimizer", None)
    scale = getattr(optimizer, "cur_scale", None)
    if scale is None:
        scale = getattr(getattr(optimizer, "loss_scaler", None), "cur_scale", None)
    if scale is not None:
        out["loss_scale"] = float(scale)
    if getattr(engine, "skipped_steps", None) is not None:
        out["skipped_steps"] = int(engine.skipped_steps)
    return out


class LossScaleMixin:
    """Put a `DynamicLossScaler` in charge of any `Trainer` subclass's FP16 training.

    Use it first in the bases: `class MyTrainer(LossScaleMixin, Seq2SeqTrainer): ...`.

    Adds to every log event `loss_scale`, `skipped_steps` (cumulative) and `overflow_rate` (skipped
    / optimizer steps since the previous log). Reading them syncs once per log, not per step. The
    LR scheduler is not stepped on a skipped optimizer step (fused optimizers included): the
    Trainer reads the device-side skip flag once per optimizer step for that.

    What it overrides is only what has to be an override: installing the scaler when the
    Accelerator is created, loading the scaler's state on resume, the log fields, and `train`
    (resume from the last *complete* checkpoint; record the exception that stops a run). What
    watches the run is a `TrainerCallback` (`hf_lossscale.integrations.callbacks`), added according to the
    arguments: the event log (`loss_scale_event_log`), the overflow diagnosis, the flushed-fraction
    probe (`loss_scale_measure_flushed`), the activation probe (`loss_scale_activation_probe`) and
    TensorBoard histograms (`report_to` with `tensorboard`).

    Args:
        loss_scale_config (`LossScaleConfig`, *optional*): wins over the arguments, the environment
            and the config file.
        loss_scale_fresh_on_resume (`bool`, *optional*, defaults to `False`): on resume, start a
            fresh scaler when the checkpoint holds no usable scaler state (otherwise an error).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refused = _async_grpo_base(cls)
        if refused is not None:
            raise TypeError(
                f"class {cls.__name__} mixes LossScaleMixin with TRL's AsyncGRPOTrainer ({refused.__module__}), "
                f"which is not supported under a loss scaler: {ASYNC_GRPO_REFUSAL}."
            )

    def __init__(
        self,
        *args: Any,
        loss_scale_config: LossScaleConfig | None = None,
        loss_scale_fresh_on_resume: bool = False,
        **kwargs: Any,
    ) -> None:
        if loss_scale_config is not None and not isinstance(loss_scale_config, LossScaleConfig):
            raise TypeError(
                f"loss_scale_config must be a LossScaleConfig, got {type(loss_scale_config).__name__}."
            )
        _refuse_setting_keywords(kwargs, args_given=kwargs.get("args", args[1] if len(args) > 1 else None))
        self._loss_scale_config = loss_scale_config
        self._loss_scale_fresh = loss_scale_fresh_on_resume
        self.loss_scaler: DynamicLossScaler | None = None
        super().__init__(*args, **kwargs)
        self.loss_normalisation = fix_loss_normalisation(self)
        self._add_loss_scale_callbacks()

    def _add_loss_scale_callbacks(self) -> None:
        args = self.args
        #: The event log (`loss_scale_log.jsonl`); its `sink` is the run's one event sink, which the
        #: other callbacks emit into and TensorBoard reads.
        self.loss_scale_events = LossScaleEventLogCallback(
            self, enabled=getattr(args, "loss_scale_event_log", True)
        )
        self.activation_probe: ActivationProbeCallback | None = None
        if getattr(args, "loss_scale_measure_flushed", False):
            # Before the event log: its end measurement comes before `run_end`.
            self.add_callback(FlushedFractionCallback(self, self.loss_scale_events))
        self.add_callback(self.loss_scale_events)
        if getattr(args, "loss_scale_preflight", False):
            self.add_callback(PreflightCallback(self, self.loss_scale_events))
        self.add_callback(OverflowDiagnosisCallback(self, self.loss_scale_events))
        if getattr(args, "loss_scale_activation_probe", False):
            self.activation_probe = ActivationProbeCallback(self)
            self.add_callback(self.activation_probe)
        if "tensorboard" in (args.report_to or []):
            from .tensorboard import LossScaleTensorBoardCallback

            self.add_callback(LossScaleTensorBoardCallback(self, self.loss_scale_events.sink))

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.loss_scaler = None
        overrides = self.args.loss_scale_overrides() if hasattr(self.args, "loss_scale_overrides") else {}
        if effective_mixed_precision(self.accelerator) != "fp16":
            if self._fp16_products_on_cpu(overrides):  # `fp16_on_cpu` applies to a model held in FP16
                overrides = {k: v for k, v in overrides.items() if k != "fp16_on_cpu"}
            if overrides or self._loss_scale_config is not None:
                warnings.warn(
                    "Loss-scale settings were given but the run is not FP16 "
                    f"(mixed_precision={effective_mixed_precision(self.accelerator)!r}): they have no effect.",
                    stacklevel=2,
                )
            return
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            # DeepSpeed's engine owns its scaler: check its fp16 section against ours, log its figures.
            config = resolve_config(self._loss_scale_config, overrides)
            plugin = self.accelerator.state.deepspeed_plugin
            check_deepspeed_fp16(config, (plugin.deepspeed_config or {}).get("fp16", {}))
            return
        self.loss_scaler = install_loss_scaler(self.accelerator, self._loss_scale_config, overrides=overrides)

    def _fp16_products_on_cpu(self, overrides: dict[str, Any]) -> bool:
        """A model held in FP16 trained on a CPU without `--fp16` (pure FP16): its matrix products run
        on FP32 kernels with one FP16 rounding (`fp16_products()`, the GPU's arithmetic at FP32 speed,
        not the CPU's ~15x slower FP16 path) unless `fp16_on_cpu="native"`. Which model that is is
        asked at each forward and backward (`model_init` makes it later; a search, several). Whether
        this is a CPU run, where `fp16_on_cpu` can apply."""
        self._fp16_products = False
        if self.accelerator.device.type != "cpu":
            return False
        if resolve_config(self._loss_scale_config, overrides).fp16_on_cpu == "native":
            return True
        self._fp16_products = True
        backward = self.accelerator.backward

        @functools.wraps(backward)
        def backward_with_fp16_products(loss: torch.Tensor, **kwargs: Any) -> None:
            with self._products_context():
                return backward(loss, **kwargs)

        self.accelerator.backward = backward_with_fp16_products
        return True

    def _products_context(self) -> contextlib.AbstractContextManager:
        model = self.model
        if model is not None and any(p.dtype == torch.float16 for p in model.parameters()):
            if not getattr(self, "_fp16_products_said", False):
                self._fp16_products_said = True
                logger.info(
                    "hf_lossscale: the FP16 model's matrix products run on FP32 kernels (fp16_products())."
                )
            return fp16_products()
        return contextlib.nullcontext()

    def autocast_smart_context_manager(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' forward context, with `fp16_products()` for a model held in FP16 on a CPU
        (see `_fp16_products_on_cpu`)."""
        if getattr(self, "_fp16_products", False):
            return self._products_context()
        return super().autocast_smart_context_manager(*args, **kwargs)

    # ------------------------------------------------------------------ logging
    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's optimizer (any it builds, `adamw_torch_fused` included), with FP32 masters in
        place of the model's trainable FP16 parameters when `master_weights` allows: before a resumed
        optimizer state is loaded into it (its moments are the masters' FP32 ones), and before the
        first step. A model held in FP32 is untouched."""
        optimizer = super().create_optimizer(*args, **kwargs)
        scaler = self.loss_scaler
        if scaler is not None and scaler.config.master_weights is not False:
            inner = inner_optimizer(optimizer)
            if scaler.master_weights.half_trainable(inner):
                n = scaler.master_weights.attach(inner)
                logger.info("hf_lossscale: %d FP16 parameter tensors step on FP32 master weights (%.1f MB).",
                            n, scaler.master_weights.bytes(inner) / 2**20)  # fmt: skip
        return optimizer

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, with the loss-scale figures on training logs only: an evaluation or
        the end-of-training summary gets none of them and leaves the "since the last log" window
        (`overflow_rate`, the telemetry snapshot) to the next training log. Non-finite numbers go
        to every `report_to` backend and `trainer_state.json` as None (JSON `null`); the metrics
        `evaluate()` returns keep them as numbers. The telemetry
        snapshots a training log read go to the run's event sink as `telemetry` events, after the log
        (the event log and TensorBoard take them from there)."""
        snapshots: dict[str, Any] = {}
        if _is_training_log(logs):
            if self.loss_scaler is None and self.accelerator.distributed_type == DistributedType.DEEPSPEED:
                logs.update(deepspeed_scale_figures(self.model_wrapped))
            if self.loss_scaler is not None:
                snapshots = self._add_loss_scale_figures(logs)
        # a copy: evaluate() returns the caller's dict as its metrics, which keep their NaN as the stock
        # Trainer's do (transformers' own `log_metrics` formats them as numbers)
        super().log(strict_json(logs), *args, **kwargs)
        for event in telemetry_events(snapshots, self.state.global_step):
            self.loss_scale_events.sink.emit(event, keep=False)  # histograms: the file keeps them

    def _previous_training_log(self) -> dict[str, Any]:
        """The counters at the previous training log, as the run's history holds them (a resumed run's
        history included, so the window is the uninterrupted run's); zeros before the first."""
        for entry in reversed(self.state.log_history):
            if "skipped_steps" in entry and "loss" in entry:
                return entry
        return {"step": 0, "skipped_steps": 0, "nonfinite_loss_steps": 0}

    def _add_loss_scale_figures(self, logs: dict[str, Any]) -> dict[str, Any]:
        """The scaler's figures into `logs`; returns the telemetry snapshots read (by source)."""
        stats = (
            self.loss_scaler.stats()
        )  # the one source of the counts: the window is a difference of its counters
        previous = self._previous_training_log()
        steps = self.state.global_step - previous["step"]
        skipped = stats["skipped_steps"] - previous["skipped_steps"]
        nonfinite = stats["nonfinite_loss_steps"] - previous.get("nonfinite_loss_steps", 0)
        if skipped < 0 or nonfinite < 0:  # a fresh scaler on resume: its counters start again at 0
            skipped, nonfinite = stats["skipped_steps"], stats["nonfinite_loss_steps"]
        logs["loss_scale"] = stats["loss_scale"]
        logs["skipped_steps"] = stats["skipped_steps"]
        logs["nonfinite_loss_steps"] = stats["nonfinite_loss_steps"]
        logs["overflow_rate"] = skipped / steps if steps > 0 else 0.0
        # 1.0 when FP16 was emulated on the CPU: such figures are not GPU measurements.
        logs["fp16_emulated"] = float(fp16_kind(self.accelerator) == "emulated")
        if "loss" in logs:
            # Steps whose loss was non-finite, in the window this loss averages.
            logs["loss_nonfinite_in_window"] = nonfinite
            if nonfinite and self.args.logging_nan_inf_filter:
                logger.warning(
                    "hf_lossscale: the loss logged at step %d averages %d optimizer step(s) whose loss was "
                    "non-finite; transformers' logging_nan_inf_filter counted each as the mean of the steps "
                    "before it in the window (0 when it came first), so the figure is not their loss "
                    "(`loss_nonfinite_in_window` counts them; logging_nan_inf_filter=False logs NaN/inf).",
                    self.state.global_step, nonfinite,
                )  # fmt: skip
        telemetry = self.loss_scaler.telemetry.read(only_new=True)
        if telemetry is not None:
            # The optimizer step the snapshot was measured at (the scaler counts one iteration per
            # optimizer step; the snapshot's `step` is the iteration before its update).
            telemetry["global_step"] = (
                self.state.global_step - self.loss_scaler.iteration + telemetry["step"] + 1
            )
            logs["grad_telemetry_step"] = telemetry["global_step"]
            # Zeros in rows that received a gradient (where underflow shows) apart from rows that
            # received none (embedding rows of tokens not in the batch, unused parameters).
            logs["grad_zero_frac"] = telemetry["touched_zero_frac"]
            logs["grad_untouched_frac"] = telemetry["untouched_frac"]
            logs["grad_subnormal_frac"] = telemetry["subnormal_frac"]
            logs["headroom_bits"] = telemetry["headroom_bits"]
        probe = self.activation_probe.read() if self.activation_probe is not None else None
        if probe is not None:
            logs["act_grad_lost_frac"] = probe["lost_frac"]
        return {"param_grads": telemetry, "activation_grads": probe}

    # ------------------------------------------------------------------ training
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`; `resume_from_checkpoint=True` resumes from the last *complete* checkpoint
        (see `last_complete_checkpoint`), not merely the highest-numbered one. An exception that
        stops the run (a `LossScaleCollapseError` included) is written to the event log, then raised."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                # the Trainer's own words first (code matches on them), then ours
                raise ValueError(
                    f"No valid checkpoint found in output directory ({self.args.output_dir}): "
                    "No complete checkpoint found (one whose trainer_state.json was written)."
                )
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException as err:
            self.loss_scale_events.record_error(err, resumed=bool(resume_from_checkpoint))
            raise

    # ------------------------------------------------------------------ checkpoints
    @property
    def _fresh_on_resume(self) -> bool:
        return self._loss_scale_fresh or bool(getattr(self.args, "loss_scale_fresh_on_resume", False))

    def _load_scaler(self, checkpoint: str | None) -> None:
        """transformers' `_load_scaler` (its `check_torch_load_is_safe`, its XLA path), under the
        resume rule: every setting from this run, the scale, trackers and counters from the
        checkpoint, one line for what differs; a checkpoint without a usable scaler state stops the
        run (unless `loss_scale_fresh_on_resume`) instead of silently resetting the scale."""
        scaler = self.loss_scaler
        if checkpoint is None or scaler is None or not scaler.is_enabled():
            return super()._load_scaler(checkpoint)
        path = os.path.join(checkpoint, SCALER_NAME)
        if not os.path.isfile(path):
            return self._no_scaler_state(
                f"Checkpoint {checkpoint} holds no loss-scaler state ({SCALER_NAME} is missing) but "
                "loss scaling is on; resuming would silently reset the scale."
            )
        current = scaler.config  # what the user passes now: it wins over the checkpoint's config
        try:
            with warnings.catch_warnings():
                # load_state_dict's own config warnings: the one line below replaces them
                for message in LOAD_CONFIG_WARNINGS:
                    warnings.filterwarnings("ignore", message=message)
                super()._load_scaler(checkpoint)
        except ValueError as err:  # the state read, but malformed (load_state_dict names the keys)
            return self._no_scaler_state(f"Invalid loss-scaler state in {path}: {err}")
        except Exception as err:  # truncated, corrupted, not a torch file
            reason = str(err).strip() or f"{type(err).__name__} (the file is {os.path.getsize(path)} bytes)"
            return self._no_scaler_state(f"Cannot read the loss-scaler state {path}: {reason}.")
        restore_settings(scaler, current)
        # the checkpoint's settings, for the one line (a small file; transformers' load read it already)
        saved = torch.load(path, map_location="cpu", weights_only=True)
        line = resume_line(saved, current, path, scale=scaler.state.host["scale"])
        if line:
            logger.warning(line)
        if scaler.state.fp32_modules:  # what "auto" moved to FP32 before the checkpoint stays there
            run_in_fp32(
                self.accelerator.unwrap_model(self.model), scaler.state.fp32_modules, include_model_own=False
            )

    def _no_scaler_state(self, problem: str) -> None:
        if self._fresh_on_resume:
            warnings.warn(f"{problem} Starting a fresh loss scaler, as requested.", stacklevel=3)
            return
        raise RuntimeError(f"{problem} {_FRESH_HINT}")


class LossScaleTrainer(LossScaleMixin, Trainer):
    """A `transformers.Trainer` whose FP16 loss scaling is a configurable `DynamicLossScaler`.

    Same constructor as `Trainer`, plus `loss_scale_config=` (wins over the arguments) and
    `loss_scale_fresh_on_resume=`. Plain `TrainingArguments` work too (then the config comes from
    the environment or the defaults). On a CPU with `fp16=True` it trains with FP16 numerics
    instead of silently in FP32: emulated by default, real CPU autocast with `fp16_on_cpu="native"`.

    Example:

    ```python
    >>> from hf_lossscale import LossScaleTrainer, LossScaleTrainingArguments
    >>> args = LossScaleTrainingArguments("out", fp16=True, loss_scale_min=16.0, loss_scale_hysteresis=2)
    >>> trainer = LossScaleTrainer(model=model, args=args, train_dataset=train_dataset)  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP
    ```
    """
