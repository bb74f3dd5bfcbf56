"""The comparison runner: one training script, run once per setting and seed with the same data
order and number of optimizer steps; FP32, FP16 + dynamic scaling, FP16 + a static scale, FP16 with
scaling off, and BF16 (autocast, no scaler) on request. `hf-lossscale compare SCRIPT [options] -- SCRIPT_ARGS`.

The script is any `HfArgumentParser` script whose trainer uses `LossScaleMixin` (our recipes, or
yours): each run writes its event log (`loss_scale_log.jsonl`) to its output folder, and this
module reads it while the run goes (a progress line per step) and after (`summary.md`,
`metrics.json`, `eval_loss.png`, `loss_scale.png`). Runs are subprocesses, started with
`accelerate launch` unless `--launcher python`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import verdict
from .events import read_new_events, read_run_events, train_log_series
from .files import DirectoryLock, LockedError, atomic_write_text

__all__ = ["SETTINGS", "RunResult", "run_comparison", "add_compare_arguments", "split_script_args"]

#: setting -> (label, flags it adds to the script's command line)
SETTINGS: dict[str, str] = {
    "fp32": "FP32",
    "dynamic": "FP16 + dynamic scaling",
    "static": "FP16 + static scale",
    "off": "FP16, scaling off",
    "bf16": "BF16 (no scaler)",
}
#: Each run's record (command, exit status, wall time), written when it ends; `--reuse_finished` reads it.
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
                entry = {k: v for k, v in e.items() if k.startswith("eval_") or k == "step"}
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
            if "skipped_steps" in e:
                result.skipped_steps = int(e["skipped_steps"])
                result.final_scale = float(e["loss_scale"])
        elif kind == "error":
            result.error = f"{e.get('type')} at step {e.get('step')}: {e.get('message', '')}"
            if e.get("collapse"):
                result.status = "collapsed"


# ---------------------------------------------------------------------- running
def launch_prefix(launcher: str, launch_config: str | None) -> list[str]:
    """The command that starts a script: `accelerate launch ...` or the plain interpreter."""
    if launcher == "python":
        return [sys.executable]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--mixed_precision", "no"]
    if launch_config:
        return [*cmd, "--config_file", launch_config]
    import torch

    # Without a config, Accelerate gives a CPU-only machine one thread unless told it is a CPU run.
    cmd += ["--num_processes", "1", "--num_machines", "1", "--dynamo_backend", "no"]
    return cmd if torch.cuda.is_available() else [*cmd, "--cpu"]


def _progress(result: RunResult, event: dict[str, Any], max_steps: int) -> str | None:
    tag = f"[{result.setting:>7} seed {result.seed}]"
    if event.get("event") == "log" and "eval_loss" in event:
        extra = "  ".join(
            f"{k} {v:.4f}" for k, v in event.items() if k.startswith("eval_") and _is_metric(k, v)
        )
        return (
            f"{tag} step {event['step']:>4}/{max_steps}  eval_loss {event['eval_loss']:.4f}  {extra}".rstrip()
        )
    if event.get("event") == "log" and "loss" in event:
        line = f"{tag} step {event['step']:>4}/{max_steps}  loss {event['loss']:.4f}"
        if "loss_scale" in event:
            line += f"  scale {scale_text(event['loss_scale'])}  skipped {event['skipped_steps']}"
        return line
    if event.get("event") == "flushed_probe":
        return (
            f"{tag} flushed to zero ({event['when']}, scale {scale_text(event['scale'])}): {_fraction(event)}"
        )
    if event.get("event") == "error":
        return f"{tag} {event['type']} at step {event['step']}"
    return None


def _is_metric(name: str, value: Any) -> bool:
    """An eval figure worth a column: not timings or counts."""
    skip = ("_runtime", "_per_second", "_preparation_time", "_samples", "eval_loss")
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not name.endswith(skip)


def run_one(
    script: str, setting: str, seed: int, opts: argparse.Namespace, script_args: list[str], out: Path
) -> RunResult:
    run_dir = out / "runs" / f"{setting}-seed{seed}"
    flags = [
        "--output_dir", str(run_dir),
        "--seed", str(seed),
        "--max_steps", str(opts.max_steps),
        "--logging_steps", "1",
        "--do_train", "--do_eval",
        *setting_flags(setting, opts.static_scale, opts.fp16_on_cpu, getattr(opts, "dynamic_init_scale", None),
                       getattr(opts, "dynamic_growth_interval", None)),
    ]  # fmt: skip
    if setting in FP16_SETTINGS and opts.flushed_probe:
        flags.append("--loss_scale_measure_flushed")
    command = [*launch_prefix(opts.launcher, opts.launch_config), script, *script_args, *flags]
    result = RunResult(setting=setting, seed=seed, output_dir=str(run_dir), command=command)
    log_path = run_dir / "run.log"
    events_path = run_dir / "loss_scale_log.jsonl"
    record_path = run_dir / RUN_RECORD
    if getattr(opts, "reuse_finished", False) and _finished_with(record_path, command):
        print(f"[{setting:>7} seed {seed}] reusing the finished run in {run_dir} (same command)", flush=True)
        result.wall_s = json.loads(record_path.read_text())["wall_s"]
        result.returncode = 0
        return _finish(result, events_path, log_path)
    if run_dir.exists():
        shutil.rmtree(run_dir)  # the runner owns this folder: a stale log must not mix in
    run_dir.mkdir(parents=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    jobs = getattr(opts, "jobs", 1)
    if jobs > 1 and "OMP_NUM_THREADS" not in env:  # parallel runs share the cores, one stream each
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    print(f"[{setting:>7} seed {seed}] {shlex.join(command)}", flush=True)
    start = time.perf_counter()
    offset = 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        _CHILDREN.add(proc)
        try:
            while True:
                done = proc.poll() is not None
                events, offset = read_new_events(events_path, offset)  # only what was appended
                for event in events:
                    line = _progress(result, event, opts.max_steps)
                    if line:
                        print(line, flush=True)
                if done:
                    break
                time.sleep(0.5)
        finally:
            _CHILDREN.discard(proc)
            _stop(proc)
    result.wall_s = time.perf_counter() - start
    result.returncode = proc.returncode
    record = {"command": command, "returncode": proc.returncode, "wall_s": result.wall_s}
    atomic_write_text(record_path, json.dumps(record, indent=1))
    return _finish(result, events_path, log_path)


#: The training processes running now: stopped when the runner is interrupted or terminated.
_CHILDREN: set[subprocess.Popen] = set()


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Terminate a child still running (SIGTERM, then SIGKILL after `grace_s`)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _on_signal(signum, frame):
    for proc in list(_CHILDREN):
        _stop(proc)
    raise SystemExit(128 + signum)


def _finished_with(record_path: Path, command: list[str]) -> bool:
    """Whether the run behind `record_path` exited 0 and was started with exactly `command`."""
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        return False
    return record.get("command") == command and record.get("returncode") == 0


def _finish(result: RunResult, events_path: Path, log_path: Path) -> RunResult:
    parse_events(result, read_run_events(events_path))
    if result.status != "collapsed":
        result.status = "ok" if result.returncode == 0 and result.eval_loss is not None else "failed"
    if result.status == "failed":
        tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
        result.error = result.error or "\n".join(tail)
        tag = f"[{result.setting:>7} seed {result.seed}]"
        print(f"{tag} FAILED (exit {result.returncode}); see {log_path}:", file=sys.stderr)
        print("\n".join(tail), file=sys.stderr)
    return result


# ---------------------------------------------------------------------- summarising
def _fraction(probe: dict[str, Any] | None) -> str:
    if probe is None:
        return "—"
    if probe["overflow"]:
        return "overflow (inf/NaN)"
    return percent(probe["flushed_fraction"])


def percent(x: float) -> str:
    """A fraction as a percentage that never rounds a small non-zero value to 0."""
    return f"{x:.2%}" if x == 0 or x >= 1e-4 else f"{100 * x:.1e}%"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summarize(results: list[RunResult], opts: argparse.Namespace) -> dict[str, Any]:
    """Per-setting aggregates, the paired verdicts and the statements `summary.md` makes, all from
    `results` (the rules: `hf_lossscale.verdict.RULES`)."""
    # a run that did not finish (a crash half-way) enters no verdict: its last mid-run evaluation is not
    # a final one. A collapse is an outcome (the scaler stopped the run): it stays, as "incomplete".
    left_out = [r for r in results if r.status == "failed"]
    results = [r for r in results if r.status != "failed"]
    records = [asdict(r) for r in results]
    by_setting: dict[str, list[RunResult]] = {}
    for r in results:
        by_setting.setdefault(r.setting, []).append(r)
    rows: dict[str, dict[str, Any]] = {}
    for setting, runs in by_setting.items():
        losses = [r.eval_loss for r in runs if r.eval_loss is not None]
        finite = [x for x in losses if math.isfinite(x)]
        rows[setting] = {
            "eval_loss": losses,
            "eval_loss_mean": _mean(finite) if finite and len(finite) == len(runs) else None,
            "spread": (max(finite) - min(finite)) if len(finite) >= 2 else None,
            "statuses": [r.status for r in runs],
        }
    fp32 = rows.get("fp32")
    statements = []
    floor = verdict.paired_verdict(records, "dynamic") if "dynamic" in rows and fp32 else None
    if fp32 is None and any(setting != "fp32" for setting in rows):
        statements.append("No verdict: no FP32 run finished, so there is no baseline to compare with.")
    for setting, row in rows.items():
        if setting == "fp32" or fp32 is None:
            continue
        label = SETTINGS[setting]
        if fp32["eval_loss_mean"] is None:
            statements.append(f"{label}: no FP32 baseline to compare with (the FP32 runs failed).")
            continue
        found = verdict.curve_finding(records, setting)
        paired = found["paired"]
        row["paired"], row["finding"] = paired, found["finding"]
        row["paired_gaps"] = paired["gaps"]
        row["verdict"] = paired["verdict"]
        if paired["verdict"] == "diverged":
            statements.append(
                f"{label}: **diverged** (non-finite eval loss in seed(s) {paired['nonfinite_seeds']})."
            )
            continue
        if row["eval_loss_mean"] is None:
            statuses = ", ".join(sorted(set(row["statuses"])))
            statements.append(f"{label}: did not finish every run ({statuses}).")
            row["verdict"] = row["finding"] = "incomplete"
            continue
        gap = row["eval_loss_mean"] - fp32["eval_loss_mean"]
        rel = gap / abs(fp32["eval_loss_mean"])
        row["gap"], row["relative_gap"] = gap, rel
        row["slowdown"] = verdict.steps_to_reach(records, setting)
        sentence = f"{label}: " + paired_text(paired, "eval loss")
        if floor is not None and setting != "dynamic" and floor["gaps"]:
            skips = sum(r.skipped_steps or 0 for r in by_setting["dynamic"])
            sentence += (
                f" Numerical floor (FP16 + dynamic's paired gaps): {_gaps(floor['gaps'])}."
                if not skips
                else f" FP16 + dynamic's paired gaps ({_gaps(floor['gaps'])}) include its {skips} skipped "
                "step(s), each of which costs a run its last learning-rate step: not a rounding-only floor."
            )
        spread = paired.get("seed_spread")
        sentence += f" Unpaired, for reference: mean gap {gap:+.4f} ({rel:+.2%})" + (
            f" against the largest seed-to-seed spread {spread:.4f}." if spread is not None else "."
        )
        sentence += " " + slowdown_text(row["slowdown"]) + f" Finding: **{row['finding']}**."
        for metric in _accuracy_metrics(results):
            other = verdict.paired_verdict(records, setting, metric)
            row.setdefault("paired_metrics", {})[metric] = other
            sentence += f" {metric}: " + paired_text(other, metric)
        if setting == "dynamic":
            within = abs(rel) <= 0.02
            row["within_2pct"] = within
            sentence += f" Within 2% of FP32: **{'yes' if within else 'no'}**."
        statements.append(sentence)
    off = rows.get("off")
    if off is not None and "finding" in off:
        statements.append(_failure_mode(off, [r for r in results if r.setting == "off"]))
    for r in results:
        if r.setting in ("static", "dynamic") and r.status == "collapsed":
            statements.append(
                f"{SETTINGS[r.setting]} (seed {r.seed}): **LossScaleCollapseError** — {r.error}"
            )
        elif r.setting == "static" and r.skipped_steps is not None:
            statements.append(
                f"{SETTINGS['static']} {scale_text(opts.static_scale)} (seed {r.seed}): skipped {r.skipped_steps} of "
                f"{r.total_steps or opts.max_steps} optimizer steps."
            )
    for r in left_out:
        reason = (r.error or "").strip().splitlines()
        statements.append(
            f"Left out of every verdict: {SETTINGS[r.setting]} seed {r.seed} ({r.status}"
            + (f", exit {r.returncode}" if r.returncode not in (0, None) else "")
            + (f": {reason[-1][:200]}" if reason else "")
            + "); it did not finish, so its last evaluation is no final one."
        )
    return {
        "rows": rows,
        "statements": statements,
        "rules": list(verdict.RULES.values()),
        "left_out": [{"setting": r.setting, "seed": r.seed, "status": r.status} for r in left_out],
    }


def _gaps(gaps: list[float]) -> str:
    return ", ".join(f"{g:+.4f}" for g in gaps)


def paired_text(paired: dict[str, Any], shown: str) -> str:
    """One sentence for a paired verdict (`hf_lossscale.verdict.paired_verdict`)."""
    if paired["verdict"] == "no baseline":
        return f"no seed with both this setting and FP32 finished ({shown})."
    seeds = ", ".join(map(str, paired["seeds"]))
    text = f"paired {shown} gap to FP32 {_gaps(paired['gaps'])} (seed {seeds}), mean {paired['mean']:+.4f}"
    if "interval" in paired:
        low, high = paired["interval"]
        text += f", 95% interval [{low:+.4f}, {high:+.4f}]"
    if paired["verdict"] == "too few seeds":
        same = {"+": "the same sign (+) in every seed", "-": "the same sign (-) in every seed"}
        return (
            f"{text}; {same.get(paired['sign'], 'signs differ between seeds')}: **no verdict** with "
            f"{paired['n']} seed{'s' if paired['n'] != 1 else ''} (the paired rule needs {verdict.MIN_SEEDS})."
        )
    word = {"worse": "worse than FP32", "better": "better than FP32"}.get(
        paired["verdict"], paired["verdict"]
    )
    return f"{text}: **{word}** (paired rule, {paired['n']} seeds)."


def slowdown_text(slowdown: list[dict[str, Any]]) -> str:
    """Where each seed's eval curve first reaches FP32's final eval loss."""
    if not slowdown:
        return "Steps to FP32's final eval loss: not measured (no eval curve)."
    parts = []
    for s in slowdown:
        fp32_at = f"FP32 at {s['fp32_step']:.0f}"
        if s["step"] is None:
            more = (
                f"; FP32 reached this run's final loss by step {s['fp32_step_to_final']:.0f}: at least "
                f"{percent_change(s['at_least_extra'])} steps"
                if s.get("at_least_extra") is not None
                else ""
            )
            parts.append(f"seed {s['seed']}: not reached in {s['last_step']} steps ({fp32_at}{more})")
        else:
            parts.append(
                f"seed {s['seed']}: step {s['step']:.0f} ({fp32_at}, {percent_change(s['extra'])} steps)"
            )
    return "Steps to reach FP32's final eval loss: " + "; ".join(parts) + "."


def percent_change(fraction: float) -> str:
    """`+12%` / `-5%`; a difference that rounds to 0% reads `+0%` (never `-0%`)."""
    return f"{fraction:+.0%}" if round(100 * fraction) != 0 else "+0%"


def _accuracy_metrics(results: list[RunResult]) -> list[str]:
    """Final-eval metrics judged beside the loss: accuracy-like ones (perplexity follows the loss)."""
    return [m for m in _metric_columns(results) if verdict.higher_is_better(m)]


def _failure_mode(row: dict[str, Any], runs: list[RunResult]) -> str:
    """Say plainly what FP16 without loss scaling did, in the words of `verdict.RULES["curve"]`."""
    flushed = [
        r.flushed_end["flushed_fraction"] for r in runs if r.flushed_end and not r.flushed_end["overflow"]
    ]
    lost = (
        f", flushing {percent(min(flushed))}-{percent(max(flushed))} of gradient elements to zero by the end"
        if flushed
        else ""
    )
    finding = row["finding"]
    if finding == "diverged":
        return f"Without loss scaling, training **diverged**{lost}."
    if finding == "incomplete":
        return "Without loss scaling, not every run finished; see the status column."
    if finding == "stalled":
        return f"Without loss scaling, training **stalled**{lost}: no new best eval loss while FP32 still improved."
    if finding == "slowed":
        return f"Without loss scaling, training **slowed**{lost}: worse than FP32 by the paired rule, still improving; it did not diverge."
    if finding == "no measurable difference":
        return f"Without loss scaling: **no measurable difference** from FP32 by the paired rule{lost}; it did not diverge."
    if finding == "better":
        return f"Without loss scaling, eval loss came out **better** than FP32 by the paired rule{lost}."
    return (
        f"Without loss scaling, the runs finished with a finite loss{lost}; too few seeds for a paired verdict "
        f"(the rule needs {verdict.MIN_SEEDS})."
    )


def _metric_columns(results: list[RunResult]) -> list[str]:
    names: list[str] = []
    for r in results:
        for k, v in r.final_eval.items():
            if _is_metric(k, v) and k not in names:
                names.append(k)
    return names


def write_summary(
    results: list[RunResult], summary: dict[str, Any], opts: argparse.Namespace, out: Path
) -> str:
    metrics = _metric_columns(results)
    fp16_kinds = sorted({r.fp16 for r in results if r.fp16})
    lines = [
        f"# Loss-scaling comparison: `{Path(opts.script).name}`",
        "",
        f"Command: `{opts.command_line}`",
        "",
        f"{opts.max_steps} optimizer steps per run; seeds {', '.join(map(str, opts.seeds))} (the same seed gives "
        "every setting the same data order and initial weights)"
        + (
            f"; {', '.join(SETTINGS[x] for x in opts.first_seed_only)} ran with seed {opts.seeds[0]} only."
            if getattr(opts, "first_seed_only", None)
            else "."
        ),
    ]
    if "emulated" in fp16_kinds:
        lines.append(
            "**FP16 was emulated on the CPU** (`fp16_emulation(policy='cuda')`: FP16 rounding, underflow and "
            "overflow at FP32 speed); these are not GPU measurements."
        )
    elif fp16_kinds:
        lines.append(f"FP16 ran as: {', '.join(fp16_kinds)}.")
    lines += [
        "",
        "Per seed, values are listed in seed order. *Flushed* = fraction of the non-zero FP32 gradient "
        "elements that are zero in FP16, on the run's first training batch against an FP32 pass of the "
        "same batch, at the scale in force at the start / the end of training.",
        "",
    ]
    head = ["Setting", "FP16", "eval loss", *metrics, "skipped steps", "final scale", "flushed (start)",
            "flushed (end)", "train time (s)", "status"]  # fmt: skip
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for setting in SETTINGS:
        runs = [r for r in results if r.setting == setting]
        if not runs:
            continue
        label = SETTINGS[setting] + (f" {scale_text(opts.static_scale)}" if setting == "static" else "")

        def per_seed(fn, runs=runs):
            return " / ".join(fn(r) for r in runs)

        cells = [
            label,
            per_seed(lambda r: r.fp16 or "—"),
            per_seed(lambda r: _num(r.eval_loss)),
            *[per_seed(lambda r, m=m: _num(r.final_eval.get(m))) for m in metrics],
            per_seed(
                lambda r: (
                    "—" if r.skipped_steps is None else f"{r.skipped_steps}/{r.total_steps or opts.max_steps}"
                )
            ),
            per_seed(lambda r: scale_text(r.final_scale)),
            per_seed(lambda r: _fraction(r.flushed_start)),
            per_seed(lambda r: _fraction(r.flushed_end)),
            per_seed(lambda r: _num(r.train_runtime_s, 1)),
            per_seed(lambda r: r.status),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *verdict_table(summary), "## What the runs show", ""]
    lines += [f"- {s}" for s in summary["statements"]] or ["- (no FP16 setting to compare)"]
    lines += ["", "## Rules", "", *[f"- {rule}" for rule in summary.get("rules", [])]]
    lines += [
        "",
        "Plots: `eval_loss.png` (eval loss vs step), `gap.png` (paired eval-loss gap to FP32 vs step, per seed; "
        "dynamic and off), "
        "`loss_scale.png` (scale vs step, skipped steps marked).",
        "",
    ]
    text = "\n".join(lines)
    atomic_write_text(out / "summary.md", text)
    return text


def verdict_table(summary: dict[str, Any]) -> list[str]:
    """The paired verdicts as a table: one row per FP16 setting."""
    judged = {k: v for k, v in summary["rows"].items() if "paired" in v and v["paired"]["gaps"]}
    if not judged:
        return []
    lines = [
        "## Paired verdicts (eval loss; rules below)",
        "",
        "| Setting | paired gap per seed | mean | 95% interval | verdict | finding | steps to FP32's final loss "
        "| unpaired gap / largest seed spread |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for setting, row in judged.items():
        p = row["paired"]
        interval = "[{:+.4f}, {:+.4f}]".format(*p["interval"]) if "interval" in p else "—"
        slow = ", ".join(
            percent_change(s["extra"])
            if s["step"] is not None
            else (
                f">= {percent_change(s['at_least_extra'])}"
                if s.get("at_least_extra") is not None
                else "not reached"
            )
            for s in row.get("slowdown", [])
        )
        spread = p.get("seed_spread")
        unpaired = (
            f"{row['gap']:+.4f} / " + ("—" if spread is None else f"{spread:.4f}") if "gap" in row else "—"
        )
        lines.append(
            f"| {SETTINGS[setting]} | {_gaps(p['gaps'])} | {p['mean']:+.4f} | {interval} | {p['verdict']} | "
            f"{row['finding']} | {slow or '—'} | {unpaired} |"
        )
    return [*lines, ""]


def scale_text(scale: float | None) -> str:
    """A loss scale as `2^k` when it is a power of two (they usually are), else as a number."""
    if scale is None:
        return "—"
    if scale > 0 and math.isfinite(scale) and math.log2(scale).is_integer():
        return f"2^{int(math.log2(scale))}"
    return f"{scale:g}"


def _num(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}f}" if math.isfinite(value) else str(value)


_LINESTYLES = ("-", "--", ":", "-.")


def write_plots(results: list[RunResult], opts: argparse.Namespace, out: Path) -> list[str]:
    from ._extras import need

    matplotlib = need("matplotlib", "hf-lossscale compare's plots", "tools")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import plot_scale

    colors = {
        "fp32": "black",
        "dynamic": "tab:blue",
        "static": "tab:red",
        "off": "tab:orange",
        "bf16": "tab:green",
    }

    def style(seed: int) -> str:  # one line style per seed, in the order given
        return _LINESTYLES[opts.seeds.index(seed) % len(_LINESTYLES)] if seed in opts.seeds else "-"

    def save(fig, ax, name: str, ylabel: str, title: str) -> str:
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        return name

    written = []
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in sorted(results, key=lambda r: r.setting != "fp32"):  # FP32 first, wide, underneath
        if r.evals:
            ax.plot([e["step"] for e in r.evals], [e["eval_loss"] for e in r.evals], marker="o",
                    color=colors[r.setting], linestyle=style(r.seed), linewidth=4 if r.setting == "fp32" else 1.5,
                    alpha=0.45 if r.setting == "fp32" else 1.0, label=f"{SETTINGS[r.setting]} (seed {r.seed})")  # fmt: skip
    written.append(save(fig, ax, "eval_loss.png", "eval loss", "Eval loss per setting"))

    fig, ax = plt.subplots(figsize=(7, 4.2))
    records = [asdict(r) for r in results]
    for setting in ("dynamic", "off", "bf16"):  # the static storm's gap (several nats) would flatten these
        for seed, points in verdict.gap_curves(records, setting).items():
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=colors[setting],
                        linestyle=style(seed), label=f"{SETTINGS[setting]} (seed {seed})")  # fmt: skip
    ax.axhline(0.0, color="black", linewidth=1)
    written.append(save(fig, ax, "gap.png", "eval loss - FP32 eval loss (same seed)",
                        "Paired gap to FP32: grows, holds or closes"))  # fmt: skip

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        if r.setting not in FP16_SETTINGS:
            continue
        plot_scale(ax, r.steps, r.loss_scale, r.skipped_at, color=colors[r.setting],
                   label=f"{SETTINGS[r.setting]} (seed {r.seed})")  # fmt: skip
    written.append(save(fig, ax, "loss_scale.png", "loss scale (x = skipped step)", "Loss scale per step"))
    return written


# ---------------------------------------------------------------------- entry point
def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "script", help="A training script that uses LossScaleTrainer (e.g. recipes/language_modeling.py)."
    )
    parser.add_argument(
        "--settings",
        default=",".join(DEFAULT_SETTINGS),
        help=f"Comma-separated, from {list(SETTINGS)}; default {','.join(DEFAULT_SETTINGS)} (bf16 on request: "
        "not every GPU has it).",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="One run per setting and seed.")
    parser.add_argument(
        "--max_steps", type=int, default=40, help="Optimizer steps per run (the same for all)."
    )
    parser.add_argument(
        "--output_dir", default="compare_out", help="Where summary.md, metrics.json and plots go."
    )
    parser.add_argument("--static_scale", type=float, default=2.0**24, help="The static setting's scale.")
    parser.add_argument("--fp16_on_cpu", choices=["emulate", "native"], default="emulate",
                        help="FP16 on a CPU: emulated (default, FP32 speed) or native autocast (~20x slower).")  # fmt: skip
    parser.add_argument("--launcher", choices=["accelerate", "python"], default="accelerate",
                        help="Start each run with `accelerate launch` (default) or the plain interpreter.")  # fmt: skip
    parser.add_argument("--launch_config", default=None, help="An `accelerate launch --config_file` YAML.")
    parser.add_argument("--first_seed_only", default="",
                        help="Comma-separated settings run with the first seed only (e.g. 'static', whose "
                        "overflow storm needs no noise estimate).")  # fmt: skip
    parser.add_argument("--reuse_finished", action="store_true",
                        help="Keep a run that already finished (exit 0) in OUTPUT_DIR/runs with the same command "
                        "instead of rerunning it: resume an interrupted comparison, or run seeds in parallel "
                        "into one OUTPUT_DIR and summarise them together.")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1,
                        help="Runs at a time (each a subprocess; with more than 1, each gets OMP_NUM_THREADS = "
                        "cores / jobs unless you set it). Two one-thread runs beat one two-thread run on a CPU.")  # fmt: skip
    parser.add_argument("--dynamic_init_scale", type=float, default=None,
                        help="The dynamic setting's initial scale (default: the scaler's, 2^16). Start it above "
                        "where the gradients overflow to watch it back off.")  # fmt: skip
    parser.add_argument("--dynamic_growth_interval", type=int, default=None,
                        help="The dynamic setting's clean steps before it doubles (default: the scaler's, 2000).")  # fmt: skip
    parser.add_argument("--no_flushed_probe", dest="flushed_probe", action="store_false",
                        help="Skip the flushed-fraction measurement of each FP16 run.")  # fmt: skip


def validate(opts: argparse.Namespace) -> None:
    settings = [s.strip() for s in opts.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or not settings:
        raise SystemExit(f"--settings {opts.settings!r}: unknown {unknown}; choose from {list(SETTINGS)}.")
    opts.settings = settings
    first_only = [s.strip() for s in (getattr(opts, "first_seed_only", "") or "").split(",") if s.strip()]
    if any(s not in settings for s in first_only):
        raise SystemExit(f"--first_seed_only {first_only}: each must be one of --settings {settings}.")
    opts.first_seed_only = first_only
    opts.script_args = list(getattr(opts, "script_args", []))
    owned = sorted({a.split("=", 1)[0] for a in opts.script_args if a.split("=", 1)[0] in OWNED_FLAGS})
    if owned:
        raise SystemExit(
            f"Script arguments {owned} are set by the runner per setting; use the runner's options instead."
        )
    if opts.max_steps < 1:
        raise SystemExit(f"--max_steps must be at least 1, got {opts.max_steps}.")
    if not opts.static_scale > 0 or not math.isfinite(opts.static_scale):
        raise SystemExit(f"--static_scale must be a positive finite number, got {opts.static_scale}.")
    if not Path(opts.script).is_file():
        raise SystemExit(f"No script {opts.script!r}.")
    if getattr(opts, "jobs", 1) < 1:
        raise SystemExit(f"--jobs must be at least 1, got {opts.jobs}.")
    init = getattr(opts, "dynamic_init_scale", None)
    if init is not None and not (init > 0 and math.isfinite(init)):
        raise SystemExit(f"--dynamic_init_scale must be a positive finite number, got {init}.")
    interval = getattr(opts, "dynamic_growth_interval", None)
    if interval is not None and interval < 1:
        raise SystemExit(f"--dynamic_growth_interval must be at least 1, got {interval}.")
    if len(set(opts.seeds)) != len(opts.seeds):
        raise SystemExit(f"--seeds {opts.seeds} repeats a seed.")


def run_comparison(opts: argparse.Namespace) -> tuple[list[RunResult], dict[str, Any]]:
    """Run every setting and seed, then write summary.md, metrics.json and the plots."""
    validate(opts)
    from ._extras import need

    need("matplotlib", "hf-lossscale compare's plots", "tools")  # before hours of runs, not after
    out = Path(opts.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        lock = DirectoryLock(out, what="another hf-lossscale compare").__enter__()
    except LockedError as err:
        raise SystemExit(str(err)) from None
    handlers = {}
    if threading.current_thread() is threading.main_thread():  # SIGTERM/SIGINT stop the children too
        handlers = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _run_comparison(opts, out)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for proc in list(_CHILDREN):
            _stop(proc)
        lock.__exit__(None, None, None)


def _run_comparison(opts: argparse.Namespace, out: Path) -> tuple[list[RunResult], dict[str, Any]]:
    opts.command_line = getattr(opts, "command_line", None) or "hf_lossscale.compare.run_comparison(...)"
    plan = [(setting, seed) for seed in opts.seeds for setting in opts.settings
            if seed == opts.seeds[0] or setting not in opts.first_seed_only]  # fmt: skip
    with ThreadPoolExecutor(max_workers=getattr(opts, "jobs", 1)) as pool:
        futures = [pool.submit(run_one, opts.script, st, sd, opts, opts.script_args, out) for st, sd in plan]
        results = [f.result() for f in futures]
    summary = summarize(results, opts)
    text = write_summary(results, summary, opts, out)
    plots = write_plots(results, opts, out)
    payload = {
        "command": opts.command_line,
        "options": {k: v for k, v in vars(opts).items() if k != "command_line"},
        "runs": [asdict(r) for r in results],
        "summary": summary,
        "plots": plots,
    }
    atomic_write_text(out / "metrics.json", json.dumps(payload, indent=2, default=str))
    print(text)
    print(f"Wrote {out / 'summary.md'}, {out / 'metrics.json'}, " + ", ".join(str(out / p) for p in plots))
    return results, summary


def split_script_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """`[runner options] -- [script flags]` -> the two lists."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []
