"""Running one comparison run: the launch command, the subprocess, its progress lines, its record
(`run.json`, which `--reuse_finished` reads), and stopping the runs when the runner is stopped."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..core.events import read_new_events, read_run_events
from .files import atomic_write_text
from .runs import FP16_SETTINGS, RUN_RECORD, RunResult, is_metric, parse_events, setting_flags
from .summary import fraction_text, scale_text


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
            f"{k} {v:.4f}" for k, v in event.items() if k.startswith("eval_") and is_metric(k, v)
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
        return f"{tag} flushed to zero ({event['when']}, scale {scale_text(event['scale'])}): {fraction_text(event)}"
    if event.get("event") == "error":
        return f"{tag} {event['type']} at step {event['step']}"
    return None


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
    if getattr(opts, "reuse_finished", False) and finished_with(record_path, command):
        print(f"[{setting:>7} seed {seed}] reusing the finished run in {run_dir} (same command)", flush=True)
        result.wall_s = json.loads(record_path.read_text())["wall_s"]
        result.returncode = 0
        return _finish(result, events_path, log_path)
    if STOPPING.is_set():  # the runner was stopped: start nothing new
        raise RunnerStopped(f"{setting} seed {seed}: not started, the comparison was stopped")
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
        # A session of its own: a stop reaches the run's whole process tree (accelerate launch and the
        # training process it starts), and a Ctrl-C in the terminal reaches only the runner, which stops it.
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        CHILDREN.add(proc)
        if STOPPING.is_set():  # a stop between the check above and the start
            stop(proc)
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
            CHILDREN.discard(proc)
            stop(proc)
    result.wall_s = time.perf_counter() - start
    result.returncode = proc.returncode
    record = {"command": command, "returncode": proc.returncode, "wall_s": result.wall_s}
    atomic_write_text(record_path, json.dumps(record, indent=1))
    return _finish(result, events_path, log_path)


#: The training processes running now: stopped when the runner is interrupted or terminated.
CHILDREN: set[subprocess.Popen] = set()
#: Set when the runner is stopped (a signal, an error): no run starts after it.
STOPPING = threading.Event()


class RunnerStopped(RuntimeError):
    """A run that was not started because the comparison was stopped."""


def _signal_tree(proc: subprocess.Popen, sig: int) -> None:
    """`sig` to the run's process group (its own session: the launcher and the training process)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a run's whole process tree: SIGTERM, then SIGKILL after `grace_s`; whatever of the tree
    outlived its leader is killed too."""
    if proc.poll() is not None and not STOPPING.is_set():
        return  # it ended by itself: its launcher waited for its own children
    if proc.poll() is None:
        _signal_tree(proc, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    _signal_tree(proc, signal.SIGKILL)  # what of the tree outlived the launcher (or the grace)
    proc.wait()


def on_signal(signum, frame):
    """SIGTERM / SIGINT to the runner: start nothing new, signal every run now (their trees stop in
    parallel, within seconds), and leave through SystemExit (the caller waits for them)."""
    STOPPING.set()
    for proc in list(CHILDREN):
        if proc.poll() is None:
            _signal_tree(proc, signal.SIGTERM)
    raise SystemExit(128 + signum)


def finished_with(record_path: Path, command: list[str]) -> bool:
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
