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
import shlex
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .files import DirectoryLock, LockedError, atomic_write_text, disk_error, publish, staging
from .messages import capped
from .plots import write_plots
from .runner import (
    CHILDREN,
    STOPPING,
    WATCHER,
    finished_with,
    launch_prefix,
    on_signal,
    run_one,
    stop,
    wait_for_earlier_runs,
)
from .runs import DEFAULT_SETTINGS, FP16_SETTINGS, OWNED_FLAGS, RUN_RECORD, SETTINGS, RunResult, setting_flags
from .summary import percent, percent_change, scale_text, summarize, write_summary

_finished_with = finished_with  # its name before the split into runs / runner / summary / plots

__all__ = [
    "SETTINGS", "RunResult", "run_comparison", "add_compare_arguments", "split_script_args",
    # importable from here as before the split (runs / runner / summary / plots)
    "DEFAULT_SETTINGS", "FP16_SETTINGS", "OWNED_FLAGS", "RUN_RECORD", "launch_prefix", "percent", "percent_change",
    "scale_text", "setting_flags", "summarize", "write_summary", "write_plots",
]  # fmt: skip


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
                        help="Keep a run in OUTPUT_DIR/runs that provably finished with the same inputs instead "
                        "of rerunning it: the same command, HF_LOSSSCALE_* environment and files it names (their "
                        "digests), exit 0, and an event log that reached run_end at --max_steps with a final "
                        "evaluation. Any other run is rerun, with the reason in one line. Resumes an "
                        "interrupted comparison, or adds seeds to one (one comparison per OUTPUT_DIR at a time).")  # fmt: skip
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
        raise SystemExit(
            f"--settings {capped(opts.settings)}: unknown {capped(unknown)}; choose from {list(SETTINGS)}."
        )
    opts.settings = settings
    first_only = [s.strip() for s in (getattr(opts, "first_seed_only", "") or "").split(",") if s.strip()]
    if any(s not in settings for s in first_only):
        raise SystemExit(
            f"--first_seed_only {capped(first_only)}: each must be one of --settings {settings}."
        )
    opts.first_seed_only = first_only
    opts.script_args = list(getattr(opts, "script_args", []))
    owned = sorted({a.split("=", 1)[0] for a in opts.script_args if a.split("=", 1)[0] in OWNED_FLAGS})
    if owned:
        raise SystemExit(
            f"Script arguments {capped(owned)} are set by the runner per setting; use the runner's options instead."
        )
    if opts.max_steps < 1:
        raise SystemExit(f"--max_steps must be at least 1, got {opts.max_steps}.")
    if not opts.static_scale > 0 or not math.isfinite(opts.static_scale):
        raise SystemExit(f"--static_scale must be a positive finite number, got {opts.static_scale}.")
    if not Path(opts.script).is_file():
        raise SystemExit(f"No script {capped(opts.script)}.")
    if getattr(opts, "jobs", 1) < 1:
        raise SystemExit(f"--jobs must be at least 1, got {opts.jobs}.")
    init = getattr(opts, "dynamic_init_scale", None)
    if init is not None and not (init > 0 and math.isfinite(init)):
        raise SystemExit(f"--dynamic_init_scale must be a positive finite number, got {init}.")
    interval = getattr(opts, "dynamic_growth_interval", None)
    if interval is not None and interval < 1:
        raise SystemExit(f"--dynamic_growth_interval must be at least 1, got {interval}.")
    if len(set(opts.seeds)) != len(opts.seeds):
        raise SystemExit(f"--seeds {capped(opts.seeds)} repeats a seed.")


def run_comparison(opts: argparse.Namespace) -> tuple[list[RunResult], dict[str, Any]]:
    """Run every setting and seed, then write summary.md, metrics.json and the plots."""
    validate(opts)
    from .._extras import need

    need("matplotlib", "hf-lossscale compare's plots", "tools")  # before hours of runs, not after
    if "bf16" in opts.settings:
        from .bf16 import native_bf16, slow_bf16_warning

        native, line = native_bf16()
        if not native:
            print(f"warning: {slow_bf16_warning(line)}", file=sys.stderr, flush=True)
    out = Path(opts.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        lock = DirectoryLock(out, what="another hf-lossscale compare").__enter__()
    except LockedError as err:
        raise SystemExit(str(err)) from None
    handlers = {}
    if threading.current_thread() is threading.main_thread():  # SIGTERM/SIGINT/SIGHUP stop the children too
        handlers = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        # A runner killed before it could stop its runs (SIGKILL, the OOM killer) leaves them to its
        # watcher, which stops them within seconds: wait for that, never delete a folder under them.
        live = wait_for_earlier_runs(out)
        if live:
            groups = ", ".join(f"{d.name} (process group {g})" for d, g in live)
            raise SystemExit(
                f"Training from an earlier comparison still runs in {out / 'runs'}: {groups}. "
                f"Stop it (kill -- -PGID) and start again."
            )
        return _run_comparison(opts, out)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for proc in list(CHILDREN):
            stop(proc)
        WATCHER.close()
        lock.__exit__(None, None, None)


#: The signals that stop a comparison (SIGHUP: a closed terminal, a lost ssh session).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _run_comparison(opts: argparse.Namespace, out: Path) -> tuple[list[RunResult], dict[str, Any]]:
    opts.command_line = (
        getattr(opts, "command_line", None) or "hf_lossscale.tools.compare.run_comparison(...)"
    )
    plan = [(setting, seed) for seed in opts.seeds for setting in opts.settings
            if seed == opts.seeds[0] or setting not in opts.first_seed_only]  # fmt: skip
    STOPPING.clear()
    pool = ThreadPoolExecutor(max_workers=getattr(opts, "jobs", 1))
    try:
        futures = [pool.submit(run_one, opts.script, st, sd, opts, opts.script_args, out) for st, sd in plan]
        results = [f.result() for f in futures]
    except BaseException:
        # Stopped (a signal, a failed run's error): the queued runs never start, the running ones are
        # stopped and their workers return within seconds; summary.md and metrics.json are not written.
        STOPPING.set()
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(CHILDREN):
            stop(proc)
        raise
    finally:
        pool.shutdown(wait=True)
    summary = summarize(results, opts)
    text, plots = write_outputs(results, summary, opts, out)
    print(text)
    print(f"Wrote {out / 'summary.md'}, {out / 'metrics.json'}, " + ", ".join(str(out / p) for p in plots))
    return results, summary


def write_outputs(
    results: list[RunResult], summary: dict[str, Any], opts: argparse.Namespace, out: Path
) -> tuple[str, list[str]]:
    """summary.md, the plots and metrics.json, published as one set (`files.publish`): after any
    failure the folder holds the previous complete set or this one. A full disk is one line."""
    try:
        with staging(out) as staged:
            text = write_summary(results, summary, opts, staged)
            plots = write_plots(results, opts, staged)
            payload = {
                "command": opts.command_line,
                "options": {k: v for k, v in vars(opts).items() if k != "command_line"},
                "runs": [asdict(r) for r in results],
                "summary": summary,
                "plots": plots,
            }
            atomic_write_text(staged / "metrics.json", json.dumps(payload, indent=2, default=str))
            publish(staged, out, ["summary.md", *plots, "metrics.json"])
    except OSError as err:
        line = disk_error(err, "the comparison's summary, plots and metrics", out)
        if line is None:
            raise
        raise SystemExit(line) from None
    return text, plots


def main(argv: list[str], prog: str = "hf-lossscale compare") -> int:
    """`hf-lossscale compare [options] SCRIPT [-- SCRIPT FLAGS]`: 1 when a run failed, else 0."""
    own, script_args = split_script_args(list(argv))
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_compare_arguments(parser)
    opts = parser.parse_args(own)
    opts.script_args = script_args
    opts.command_line = shlex.join([*prog.split(), *argv])
    try:
        results, _ = run_comparison(opts)
    except OSError as err:  # a run's log or record on a full disk: one line, not a traceback
        line = disk_error(err, "the comparison's files", opts.output_dir, kept=False)
        if line is None:
            raise
        raise SystemExit(line) from None
    return 1 if any(r.status == "failed" for r in results) else 0


def split_script_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """`[runner options] -- [script flags]` -> the two lists."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []
