"""Running one comparison run: the launch command, the subprocess, its progress lines, its record
(`run.json`, which `--reuse_finished` reads), and stopping the runs when the runner is stopped."""

from __future__ import annotations

import argparse
import hashlib
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

from ..core.events import EVENT_LOG_NAME, read_new_events, read_run_events
from .files import atomic_write_text
from .messages import capped
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


def _figure(value: Any) -> str:
    """A logged figure; the event log writes a non-finite one as null."""
    return "non-finite" if value is None else f"{value:.4f}"


def _progress(result: RunResult, event: dict[str, Any], max_steps: int) -> str | None:
    tag = f"[{result.setting:>7} seed {result.seed}]"
    if event.get("event") == "log" and "eval_loss" in event:
        extra = "  ".join(
            f"{k} {v:.4f}" for k, v in event.items() if k.startswith("eval_") and is_metric(k, v)
        )
        return f"{tag} step {event['step']:>4}/{max_steps}  eval_loss {_figure(event['eval_loss'])}  {extra}".rstrip()
    if event.get("event") == "log" and "loss" in event:
        line = f"{tag} step {event['step']:>4}/{max_steps}  loss {_figure(event['loss'])}"
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
    tag = f"[{setting:>7} seed {seed}]"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    jobs = getattr(opts, "jobs", 1)
    if jobs > 1 and "OMP_NUM_THREADS" not in env:  # parallel runs share the cores, one stream each
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    inputs = run_inputs(command, env, own=run_dir)
    if getattr(opts, "reuse_finished", False):
        why_not = reuse_problem(run_dir, command, inputs, opts.max_steps)
        if why_not is None:
            print(f"{tag} reusing the finished run in {run_dir} (same command and inputs)", flush=True)
            record = json.loads(record_path.read_text())
            result.wall_s = float(record["wall_s"])
            result.returncode = 0
            return _finish(result, events_path, log_path, opts.max_steps)
        print(f"{tag} rerunning: {why_not}", flush=True)
    if STOPPING.is_set():  # the runner was stopped: start nothing new
        raise RunnerStopped(f"{setting} seed {seed}: not started, the comparison was stopped")
    if run_dir.exists():
        live = live_run_group(run_dir)
        if live is not None:  # an earlier runner's training still writes here: never delete under it
            raise RunnerStopped(
                f"{setting} seed {seed}: process group {live} of an earlier run still writes in {run_dir}; "
                f"stop it (kill -- -{live}) and start again."
            )
        shutil.rmtree(run_dir)  # the runner owns this folder: a stale log must not mix in
    run_dir.mkdir(parents=True)
    print(f"{tag} {shlex.join(command)}", flush=True)
    start = time.perf_counter()
    offset = 0
    with open(log_path, "w") as log:
        # A session of its own: a stop reaches the run's whole process tree (accelerate launch and the
        # training process it starts), and a Ctrl-C in the terminal reaches only the runner, which stops it.
        # The watcher (a process of its own, see `_Watcher`) stops that session if the runner dies
        # without stopping it (SIGKILL, the OOM killer); the launcher also gets a parent-death signal.
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=_parent_death_signal,
        )  # fmt: skip
        CHILDREN.add(proc)
        WATCHER.watch(proc.pid)
        _write_pgid(run_dir, proc.pid)
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
            WATCHER.unwatch(proc.pid)
            (run_dir / PGID_FILE).unlink(missing_ok=True)
    result.wall_s = time.perf_counter() - start
    result.returncode = proc.returncode
    result = _finish(result, events_path, log_path, opts.max_steps)
    record = {
        "command": command,
        "returncode": proc.returncode,
        "wall_s": result.wall_s,
        "max_steps": opts.max_steps,
        "inputs": inputs,
        "loss_scale_config": _logged_config(events_path),
    }
    atomic_write_text(record_path, json.dumps(record, indent=1))
    return result


# ---------------------------------------------------------------------- no orphans
#: In a run's folder while its process group runs: the group id (the launcher's pid).
PGID_FILE = ".hf_lossscale.pgid"


def _write_pgid(run_dir: Path, pgid: int) -> None:
    try:
        atomic_write_text(run_dir / PGID_FILE, str(pgid))
    except OSError:
        pass  # best effort: the watcher still stops the group


def live_run_group(run_dir: Path) -> int | None:
    """The process group of an earlier run in `run_dir` that still has a live process, else None.
    Where `/proc` shows the group's members, one must name the run's folder (a recycled process id
    is not mistaken for the run)."""
    try:
        pgid = int((run_dir / PGID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    if pgid <= 1:
        return None
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pgid
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return pgid
    marker = f"{run_dir.parent.name}/{run_dir.name}".encode()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) == pgid and marker in (entry / "cmdline").read_bytes():
                return pgid
        except (OSError, ValueError, IndexError):
            continue
    return None


#: How long a runner waits for an earlier runner's training to end (its watcher's grace, and more).
EARLIER_RUNS_WAIT_S = 15.0


def wait_for_earlier_runs(out: Path, timeout_s: float | None = None) -> list[tuple[Path, int]]:
    """Wait up to `timeout_s` (`EARLIER_RUNS_WAIT_S`) for the training of an earlier runner in `out`
    (one killed before it could stop its runs: its watcher stops them within seconds) to end; what
    still runs after it."""
    deadline = time.monotonic() + (EARLIER_RUNS_WAIT_S if timeout_s is None else timeout_s)
    while True:
        live = [(d, g) for d in sorted((out / "runs").glob("*")) if (g := live_run_group(d)) is not None]
        if not live or time.monotonic() >= deadline:
            return live
        time.sleep(0.2)


_PR_SET_PDEATHSIG = 1
try:  # Linux: loaded before any fork (a preexec_fn must not import or allocate much)
    import ctypes

    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:  # pragma: no cover
    _LIBC = None


def _parent_death_signal() -> None:
    """In the launcher, between fork and exec: SIGTERM when the runner dies."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


#: The watcher: stdlib only, no imports of ours. It reads "+PGID" / "-PGID" lines from the runner;
#: at end of input (the runner ended, however: exit, SIGKILL, the OOM killer) it sends SIGTERM to each
#: group still listed, and SIGKILL to what is left of them after a grace period.
_WATCHER_CODE = """
import os, signal, sys, time
for s in (signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
groups = set()
for line in sys.stdin:
    try:
        (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))
    except (ValueError, IndexError):
        pass
def alive(g):
    try:
        os.killpg(g, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
for g in groups:
    try:
        os.killpg(g, signal.SIGTERM)
    except OSError:
        pass
deadline = time.monotonic() + float(sys.argv[1])
while any(alive(g) for g in groups) and time.monotonic() < deadline:
    time.sleep(0.1)
for g in groups:
    try:
        os.killpg(g, signal.SIGKILL)
    except OSError:
        pass
"""


class _Watcher:
    """One watcher process per runner, started with the first run: the pipe it reads is the runner's
    alone, so it sees end of input exactly when the runner is gone."""

    GRACE_S = 5.0

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _send(self, line: str) -> None:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                # its own session: a terminal's SIGHUP or Ctrl-C does not reach it
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", _WATCHER_CODE, str(self.GRACE_S)],
                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True,
                )  # fmt: skip
            try:
                self._proc.stdin.write(line + "\n")
                self._proc.stdin.flush()
            except OSError:
                pass

    def watch(self, pgid: int) -> None:
        self._send(f"+{pgid}")

    def unwatch(self, pgid: int) -> None:
        if self._proc is not None:
            self._send(f"-{pgid}")

    def close(self) -> None:
        """The runner is done: the watcher ends (it stops any group still listed)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(self.GRACE_S + 5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


WATCHER = _Watcher()


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
    """Whether the run behind `record_path` exited 0 and was started with exactly `command` (the
    record only; `reuse_problem` is what `--reuse_finished` asks)."""
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("command") == command and record.get("returncode") == 0


# ---------------------------------------------------------------------- what a run read
#: The environment a run's loss-scale config depends on, besides its command line.
ENV_PREFIX = "HF_LOSSSCALE_"
_HASHES: dict[tuple[str, int, int], str] = {}


def _digest(path: Path) -> str:
    """sha256 of a file's bytes (cached by path, size and mtime); of a folder's listing (names, sizes,
    mtimes) for a folder, e.g. a model directory."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _HASHES:
        return _HASHES[key]
    h = hashlib.sha256()
    if path.is_dir():
        for i, entry in enumerate(sorted(p for p in path.rglob("*") if p.is_file())):
            if i >= 10_000:
                h.update(b"...more")
                break
            est = entry.stat()
            h.update(f"{entry.relative_to(path)}\0{est.st_size}\0{est.st_mtime_ns}\n".encode())
        value = "listing:" + h.hexdigest()
    else:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        value = "sha256:" + h.hexdigest()
    _HASHES[key] = value
    return value


def run_inputs(command: list[str], env: dict[str, str], own: Path | None = None) -> dict[str, Any]:
    """What a run reads besides its command line: the `HF_LOSSSCALE_*` environment and a digest of
    every file or folder the command names (the script, `--config`, `--train_file`, the model folder,
    the launch config, the file `HF_LOSSSCALE_CONFIG` names); not the run's own folder `own`."""
    variables = {k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIX)}
    named = [a.split("=", 1)[1] if a.startswith("--") and "=" in a else a for a in command[1:]]
    if variables.get(ENV_PREFIX + "CONFIG"):
        named.append(variables[ENV_PREFIX + "CONFIG"])
    files: dict[str, str] = {}
    for arg in named:
        if not arg or arg.startswith("-") or len(arg) > 4096:
            continue
        path = Path(arg)
        try:
            if own is not None and (
                path.resolve() == own.resolve() or own.resolve() in path.resolve().parents
            ):
                continue
            if path.is_file() or path.is_dir():
                files[str(path.resolve())] = _digest(path)
        except OSError as err:  # unreadable: recorded as such, so a change of that is a change too
            files[str(path)] = f"unreadable: {err.strerror}"
    return {"env": variables, "files": files}


def _logged_config(events_path: Path) -> Any:
    """The loss-scale config the run resolved (its `run_start` event), None without one."""
    start = next((e for e in read_run_events(events_path) if e.get("event") == "run_start"), {})
    return start.get("loss_scale_config")


def _changed(old: dict[str, Any], new: dict[str, Any], what: str) -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            was = "unset" if key not in old else capped(old[key], 40)
            now = "unset" if key not in new else capped(new[key], 40)
            out.append(
                f"{what} {capped(key, 80)} ({was} -> {now})"
                if what == "variable"
                else f"{capped(key, 120)} changed"
            )
    return out


def reuse_problem(run_dir: Path, command: list[str], inputs: dict[str, Any], max_steps: int) -> str | None:
    """Why the run in `run_dir` may not be reused for `command` with `inputs`, in a few words; None when
    it provably finished with the same inputs: its record says exit 0 with the same command, the same
    `HF_LOSSSCALE_*` environment and the same files; its event log holds `run_end` at step `max_steps`
    (and `total_steps == max_steps` where the scaler counts), a final evaluation, and no cut line; and
    the config its log resolved is the one recorded."""
    record_path = run_dir / RUN_RECORD
    if not record_path.exists():
        return "no finished run here" if not run_dir.exists() else f"no {RUN_RECORD} (it never ended)"
    try:
        record = json.loads(record_path.read_text())
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        float(record["wall_s"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"its {RUN_RECORD} is unreadable ({capped(err, 80)})"
    if record.get("command") != command:
        return "it ran another command"
    if record.get("returncode") != 0:
        return f"it exited with {capped(record.get('returncode'), 20)}"
    if "inputs" not in record:
        return f"its {RUN_RECORD} does not record its inputs (an older runner)"
    old = record["inputs"] if isinstance(record["inputs"], dict) else {}
    changes = _changed(old.get("env") or {}, inputs["env"], "variable")
    changes += _changed(old.get("files") or {}, inputs["files"], "file")
    if changes:
        more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
        return "its inputs changed: " + "; ".join(changes[:3]) + more
    if record.get("max_steps") not in (None, max_steps):
        return f"it ran {capped(record.get('max_steps'), 20)} steps, not {max_steps}"
    skipped: list[int] = []
    events = read_run_events(run_dir / EVENT_LOG_NAME, skipped)
    if skipped and skipped[0]:
        return f"its event log has {skipped[0]} unreadable line(s) (cut short?)"
    end = next((e for e in reversed(events) if e.get("event") == "run_end"), None)
    if end is None:
        return "its event log has no run_end (cut short)"
    steps = end.get("step")
    if steps != max_steps or end.get("total_steps", max_steps) != max_steps:
        return f"it ended at step {capped(steps, 20)} of {max_steps}"
    result = RunResult(setting="", seed=0, output_dir=str(run_dir), command=command)
    try:
        parse_events(result, events)
    except (KeyError, TypeError, ValueError) as err:
        return f"its event log does not parse ({capped(err, 80)})"
    if result.eval_loss is None:
        return "its event log has no final evaluation"
    if any(b <= a for a, b in zip(result.steps, result.steps[1:])):
        return f"its event log's steps go back ({_steps_text(result.steps)}): two writers?"
    if _logged_config(run_dir / EVENT_LOG_NAME) != record.get("loss_scale_config"):
        return "the config in its event log is not the one recorded"
    return None


def _finish(result: RunResult, events_path: Path, log_path: Path, max_steps: int | None = None) -> RunResult:
    skipped: list[int] = []
    try:
        parse_events(result, read_run_events(events_path, skipped))
    except (KeyError, TypeError, ValueError) as err:
        result.error = f"its event log does not parse: {capped(err, 200)}"
        result.status = "failed"
    if result.status != "collapsed" and result.status != "failed":
        result.status = "ok" if result.returncode == 0 and result.eval_loss is not None else "failed"
    if result.status == "ok" and any(b <= a for a, b in zip(result.steps, result.steps[1:])):
        result.status = "failed"  # two processes appended to one log (an orphan of an earlier runner)
        result.error = f"its event log's steps go back ({_steps_text(result.steps)}): two writers?"
    if result.status == "ok" and max_steps is not None and result.end_step != max_steps:
        # exit 0 but the log stops short of the last step (cut): not a final result
        result.status = "failed"
        result.error = (
            f"exit 0, but its event log ends at step {result.end_step} of {max_steps}"
            if result.end_step is not None
            else "exit 0, but its event log has no run_end (cut short)"
        )
    if result.status == "failed":
        try:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
        except OSError:
            tail = []
        tail = [capped(line, 500) for line in tail]
        result.error = result.error or "\n".join(tail)
        tag = f"[{result.setting:>7} seed {result.seed}]"
        print(f"{tag} FAILED (exit {result.returncode}); see {log_path}:", file=sys.stderr)
        print(result.error if result.returncode == 0 else "\n".join(tail), file=sys.stderr)
    return result


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:12])) + (", ..." if len(steps) > 12 else "")
