"""The comparison's settings (what each adds to the script's command line) and a run's result, as
read from its event log."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..core.events import train_log_series

#: setting -> (label, flags it adds to the script's command line)
SETTINGS: dict[str, str] = {
    "fp32": "FP32",
    "dynamic": "FP16 + dynamic scaling",
    "static": "FP16 + static scale",
    "off": "FP16, scaling off",
    "bf16": "BF16 (no scaler)",
    "master": "FP16 weights + FP32 masters",
    "kahan": "FP16 weights + Kahan compensation",
    "stochastic": "FP16 weights + stochastic rounding",
    "pure": "FP16 weights, no masters",
}
#: The settings that hold the model in FP16 with dynamic scaling: how the optimizer updates the weights.
MASTER_MODES = {"master": "true", "kahan": "kahan", "stochastic": "stochastic_rounding"}
#: Each run's record (command, exit status, wall time, its inputs: the `HF_LOSSSCALE_*` environment and
#: a digest of each file it names; the config it resolved), written when it ends; `--reuse_finished` reads it.
RUN_RECORD = "run.json"
#: Flags the runner sets itself; a script argument naming one of them is an error.
OWNED_FLAGS = (
    "--fp16",
    "--bf16",
    "--seed",
    "--output_dir",
    "--max_steps",
    "--logging_steps",
    "--do_train",
    "--do_eval",
    "--loss_scale_mode",
    "--loss_scale_fp16_on_cpu",
    "--loss_scale_measure_flushed",
    "--loss_scale_event_log",
    "--dtype",
)


def setting_flags(
    setting: str,
    static_scale: float,
    fp16_on_cpu: str,
    dynamic_init_scale: float | None = None,
    dynamic_growth_interval: int | None = None,
) -> list[str]:
    """The script flags that select one setting (the dynamic setting's start and growth interval
    only where given: the scaler's defaults otherwise)."""
    if setting == "fp32":
        return []
    if setting == "bf16":  # autocast to bfloat16 (native on CPU and CUDA), FP32 weights, no scaler
        return ["--bf16"] if _cuda_available() else ["--bf16", "--use_cpu", "true"]
    if setting == "pure":  # what users try when they force FP16 weights: the optimizer steps them in FP16
        return ["--dtype", "float16"]
    if (
        setting in MASTER_MODES
    ):  # the model held in FP16, the optimizer on FP32 masters (or below); dynamic scaling
        flags = ["--fp16", "--loss_scale_mode", "dynamic", "--loss_scale_fp16_on_cpu", fp16_on_cpu, "--dtype", "float16",
                 "--loss_scale_master_weights", MASTER_MODES[setting]]  # fmt: skip
        if dynamic_init_scale is not None:
            flags += ["--loss_scale_init", repr(float(dynamic_init_scale))]
            flags += ["--loss_scale_max", repr(max(float(dynamic_init_scale), 2.0**24))]
        if dynamic_growth_interval is not None:
            flags += ["--loss_scale_growth_interval", str(dynamic_growth_interval)]
        return flags
    flags = ["--fp16", "--loss_scale_mode", setting, "--loss_scale_fp16_on_cpu", fp16_on_cpu]
    if setting == "static":
        flags += ["--loss_scale_init", repr(float(static_scale))]
        flags += ["--loss_scale_max", repr(max(float(static_scale), 2.0**24))]
    if setting == "dynamic" and dynamic_init_scale is not None:
        flags += ["--loss_scale_init", repr(float(dynamic_init_scale))]
        flags += ["--loss_scale_max", repr(max(float(dynamic_init_scale), 2.0**24))]
    if setting == "dynamic" and dynamic_growth_interval is not None:
        flags += ["--loss_scale_growth_interval", str(dynamic_growth_interval)]
    return flags


def _cuda_available() -> bool:
    """Whether the runs get a GPU: transformers refuses `--bf16` on a CPU without `--use_cpu`."""
    import torch

    return torch.cuda.is_available()


#: What runs when `--settings` is not given: BF16 only on request (a GPU without BF16, e.g. a T4 or V100,
#: would fail that run and the whole comparison's exit status).
DEFAULT_SETTINGS = ("fp32", "dynamic", "static", "off")

#: The settings that run FP16 (the flushed-fraction probe measures FP16's number line).
FP16_SETTINGS = ("dynamic", "static", "off")


@dataclass
class RunResult:
    """What one run did, read from its event log."""

    setting: str
    seed: int
    output_dir: str
    command: list[str]
    status: str = "not run"  # "ok", "collapsed" (LossScaleCollapseError), "failed"
    returncode: int | None = None
    wall_s: float = 0.0
    train_runtime_s: float | None = None
    fp16: str | None = None  # "emulated", "native-cpu", "cuda", "BF16 native"; None for FP32
    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    loss_scale: list[float | None] = field(default_factory=list)
    skipped_at: list[int] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    final_eval: dict[str, float] = field(default_factory=dict)
    skipped_steps: int | None = None
    total_steps: int | None = None
    end_step: int | None = None  # the step of its `run_end` (None: the log has none, cut short)
    final_scale: float | None = None
    flushed_start: dict[str, Any] | None = None
    flushed_end: dict[str, Any] | None = None
    error: str | None = None

    @property
    def eval_loss(self) -> float | None:
        return self.final_eval.get("eval_loss")


def parse_events(result: RunResult, events: list[dict[str, Any]]) -> None:
    """Fill `result` from a run's events (see `LossScaleMixin`'s event log)."""
    series = train_log_series(events)
    result.steps, result.train_loss = series["steps"], series["losses"]
    result.loss_scale, result.skipped_at = series["scales"], series["skipped_at"]
    for e in events:
        kind = e.get("event")
        if kind == "run_start":
            # how the low precision ran: FP16 "emulated"/"native-cpu"/"cuda"; BF16 autocast is always native
            result.fp16 = "BF16 native" if e.get("mixed_precision") == "bf16" else e.get("fp16")
        elif kind == "log":
            if "eval_loss" in e:
                # the event log writes a non-finite figure as null: it is NaN here (a diverged run)
                entry = {
                    k: math.nan if v is None else v
                    for k, v in e.items()
                    if k.startswith("eval_") or k == "step"
                }
                result.evals.append(entry)
                result.final_eval = {k: v for k, v in entry.items() if k != "step"}
            if "train_runtime" in e:
                result.train_runtime_s = float(e["train_runtime"])
            if "skipped_steps" in e:
                result.skipped_steps = int(e["skipped_steps"])
            if "loss_scale" in e:
                result.final_scale = float(e["loss_scale"])
        elif kind == "flushed_probe":
            probe = {
                k: e[k]
                for k in ("flushed_fraction", "overflow", "scale", "loss_divisor", "fp16", "policy", "step")
            }
            if e.get("when") == "start":
                result.flushed_start = probe
            else:
                result.flushed_end = probe
        elif kind == "run_end":
            result.total_steps = e.get("total_steps")
            result.end_step = e.get("step")
            if "skipped_steps" in e:
                result.skipped_steps = int(e["skipped_steps"])
                result.final_scale = float(e["loss_scale"])
        elif kind == "error":
            result.error = f"{e.get('type')} at step {e.get('step')}: {e.get('message', '')}"
            if e.get("collapse"):
                result.status = "collapsed"


def is_metric(name: str, value: Any) -> bool:
    """An eval figure worth a column: not timings or counts."""
    skip = ("_runtime", "_per_second", "_preparation_time", "_samples", "eval_loss")
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not name.endswith(skip)
