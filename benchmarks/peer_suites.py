"""Peers' own tests, run twice: as upstream wrote them, and with our classes bound.

Copy the peer's files into a folder outside this repository (their code stays out of ours), then:

    python benchmarks/peer_suites.py accelerate  COPY/test_optimizer.py      # accelerate's tests/test_optimizer.py
    python benchmarks/peer_suites.py accelerate-script                        # its shipped test_utils/scripts/test_script.py
    python benchmarks/peer_suites.py transformers COPY/tests/trainer/test_X.py [-- -k expr]
    python benchmarks/peer_suites.py deepspeed   COPY/test_dynamic_loss_scale.py

Each suite runs in two child processes, `upstream` then `ours`, and the script prints, per suite,
the tests that ran, passed upstream and passed with ours, then each test that passes upstream and
fails with ours with its error. `--json OUT` writes those figures (atomically, at the end).

What "ours" binds, per suite:
- accelerate: every `Accelerator(mixed_precision="fp16")` gets `install_loss_scaler` right after its
  constructor. Upstream's `require_non_cpu` / `require_fp16` gates are opened in both runs (the CPU
  then trains in Accelerate's own CPU "fp16", which is FP32 upstream and emulated FP16 with ours).
- accelerate-script: the same binding; each check `main()` calls is one test (the run goes on past
  a failing one); `--nproc 2` launches it on two gloo ranks (`torch.distributed.run`).
- transformers: `transformers.Trainer` and `TrainingArguments` are `LossScaleTrainer` and
  `LossScaleTrainingArguments` (bound before the test module imports them); `transformers-fp16`: the
  same with every `TrainingArguments` made with `fp16=True`, in both runs.
- deepspeed: DeepSpeed's FP16 optimizer decides the scale with our update rule (`bind_deepspeed`).
  CAUTION: DeepSpeed's `DistributedTest` runs each test in a spawned child, which this binding (made in
  the pytest process) does not reach: bind it in every process (a `sitecustomize.py`) before trusting a
  "pass with ours" (docs/reliability.md has the figures measured that way); run
  with `DS_ACCELERATOR=cpu` and DeepSpeed's `tests/` folder (its `unit/common.py`, `simple_model.py`,
  `conftest.py`) on `PYTHONPATH`.

Ctrl-C or SIGTERM stops the running child (its whole process group) within seconds; nothing is
written then.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve()


# ---------------------------------------------------------------------- bindings (run in the child)
def open_accelerate_gates() -> None:
    """`require_non_cpu` / `require_fp16` skip the fp16 tests on a CPU: opened, in both runs."""
    import accelerate.test_utils as tu
    import accelerate.test_utils.testing as tt

    for mod in (tu, tt):
        for name in ("require_non_cpu", "require_fp16"):
            setattr(mod, name, lambda f: f)


def bind_accelerate() -> None:
    import accelerate

    from hf_lossscale import install_loss_scaler

    init = accelerate.Accelerator.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if str(self.mixed_precision) == "fp16":
            install_loss_scaler(self)

    accelerate.Accelerator.__init__ = __init__


def bind_transformers() -> None:
    import transformers
    import transformers.trainer

    from hf_lossscale import LossScaleTrainer, LossScaleTrainingArguments

    transformers.Trainer = transformers.trainer.Trainer = LossScaleTrainer
    transformers.TrainingArguments = LossScaleTrainingArguments


def force_fp16() -> None:
    """transformers-fp16: every `TrainingArguments` says `fp16=True` (in both runs): upstream's Trainer
    then trains in Accelerate's CPU FP16 (autocast and torch's GradScaler), ours in emulated FP16."""
    from transformers.training_args import TrainingArguments

    post_init = TrainingArguments.__post_init__

    def __post_init__(self):
        self.fp16 = True
        post_init(self)

    TrainingArguments.__post_init__ = __post_init__


def bind_deepspeed() -> None:
    """DeepSpeed's FP16 optimizer (`FP16_Optimizer._update_scale`, the dynamic rule its tests drive)
    decides the scale with our update rule (`core.update_rule.apply_rule`), configured from its
    `loss_scale_config` the way `integrations.deepspeed.to_deepspeed_config` maps ours to it:
    `scale_window` = `growth_interval`, `scale_factor` = growth (its inverse the backoff),
    `min_loss_scale` = `min_scale`, no hysteresis (this optimizer has none). Its own bookkeeping that
    the engine reads (`cur_iter`, `last_overflow_iter`) moves as upstream moves it; the scale is ours."""
    import torch
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer

    from hf_lossscale import LossScaleConfig
    from hf_lossscale.core.scaler_state import ScalerState
    from hf_lossscale.core.update_rule import RuleConstants, apply_rule

    upstream = FP16_Optimizer._update_scale

    def _update_scale(self, skip):
        ds = self.loss_scale_config
        if not ds.dynamic_loss_scale:
            return upstream(self, skip)
        ours = self.__dict__.get("_hf_lossscale_rule")
        if ours is None:
            config = LossScaleConfig(
                init_scale=float(ds.cur_scale), growth_interval=int(ds.scale_window),
                growth_factor=float(ds.scale_factor), backoff_factor=1.0 / float(ds.scale_factor),
                min_scale=float(ds.min_loss_scale), max_scale=2.0**64, hysteresis=1,
            )  # fmt: skip
            state = ScalerState(config)
            state.materialise(torch.device("cpu"))
            ours = self._hf_lossscale_rule = (config, state, RuleConstants.on(torch.device("cpu")))
        config, state, k = ours
        apply_rule(config, state, k, torch.tensor(bool(skip)))
        ds.cur_scale = float(state.value("scale"))
        if skip:
            ds.last_overflow_iter = ds.cur_iter
        ds.cur_iter += 1

    FP16_Optimizer._update_scale = _update_scale


SUITES = {
    "accelerate": {"kind": "pytest", "before": [open_accelerate_gates], "bind": bind_accelerate},
    "accelerate-script": {"kind": "script", "before": [], "bind": bind_accelerate},
    "transformers": {"kind": "pytest", "before": [], "bind": bind_transformers},
    "transformers-fp16": {"kind": "pytest", "before": [force_fp16], "bind": bind_transformers},
    "deepspeed": {"kind": "pytest", "before": [], "bind": bind_deepspeed},
}


class _Recorder:
    """A pytest plugin: each test's outcome (its call phase, or setup when that failed or skipped)."""

    def __init__(self):
        self.results: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = report.outcome
            if hasattr(report, "wasxfail"):
                outcome = "xfailed" if report.skipped else "xpassed"
            error = ""
            if report.failed:
                error = str(report.longrepr).strip().splitlines()[-1][:300]
            self.results[report.nodeid] = {"outcome": outcome, "error": error}


def _run_pytest(paths: list[str], extra: list[str]) -> dict:
    import pytest

    recorder = _Recorder()
    pytest.main([*paths, "-q", "-p", "no:cacheprovider", *extra], plugins=[recorder])
    return recorder.results


def _run_script(_paths: list[str], _extra: list[str]) -> dict:
    """accelerate's test_script.py: each check `main()` calls, recorded and passed over if it fails."""
    from accelerate.test_utils.scripts import test_script as script

    results: dict[str, dict] = {}
    rank = os.environ.get("RANK", "0")
    for name in [n for n in dir(script) if n.endswith("_check") or n.startswith(("test_", "check_"))]:
        func = getattr(script, name)
        if not callable(func) or getattr(func, "__module__", "") != script.__name__:
            continue

        def recorded(*args, _f=func, _n=name, **kwargs):
            key = _n + (f"({', '.join(f'{k}={v}' for k, v in kwargs.items())})" if kwargs else "")
            try:
                out = _f(*args, **kwargs)
            except Exception as e:  # recorded; the next check runs
                results[key] = {"outcome": "failed", "error": f"{type(e).__name__}: {e}"[:300]}
                traceback.print_exc()
                return None
            results.setdefault(key, {"outcome": "passed", "error": ""})
            return out

        setattr(script, name, recorded)
    script.main()
    return {f"rank{rank}::{k}": v for k, v in results.items()}


def child(suite: str, binding: str, paths: list[str], extra: list[str], out: str) -> int:
    spec = SUITES[suite]
    for step in spec["before"]:
        step()
    if binding == "ours":
        spec["bind"]()
    run = _run_pytest if spec["kind"] == "pytest" else _run_script
    results = run(paths, extra)
    rank = os.environ.get("RANK")
    target = out if rank in (None, "0") else f"{out}.rank{rank}"
    Path(target).write_text(json.dumps(results))
    return 0


# ---------------------------------------------------------------------- the two runs (the parent)
def _spawn(cmd: list[str], env: dict, cwd: str) -> int:
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True)
    try:
        return proc.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise


def run_twice(suite: str, paths: list[str], extra: list[str], nproc: int) -> dict:
    runs = {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    paths = [os.path.abspath(p) for p in paths]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parents[1]), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        for binding in ("upstream", "ours"):
            out = os.path.join(tmp, f"{binding}.json")
            inner = [str(HERE), suite, *paths, "--child", "--binding", binding, "--out", out, "--", *extra]
            if nproc > 1:  # what `accelerate launch --cpu` sets: Accelerate then runs MULTI_CPU (gloo)
                env["ACCELERATE_USE_CPU"] = "true"
                cmd = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc_per_node",
                    str(nproc),
                    *inner,
                ]
            else:
                cmd = [sys.executable, *inner]
            print(f"== {suite}: {binding} ==", flush=True)
            start = time.perf_counter()
            cwd = os.path.join(tmp, f"{binding}-cwd")  # the peers' tests write files where they run
            os.mkdir(cwd)
            code = _spawn(cmd, env, cwd)
            results = {}
            for f in sorted(Path(tmp).glob(f"{binding}.json*")):
                results.update(json.loads(f.read_text()))
            runs[binding] = {
                "results": results,
                "exit": code,
                "seconds": round(time.perf_counter() - start, 1),
            }
    return runs


def summarise(suite: str, runs: dict) -> dict:
    up, ours = runs["upstream"]["results"], runs["ours"]["results"]
    ran = sorted(set(up) | set(ours))
    regressions = [
        {"test": t, "error": ours.get(t, {"error": "did not run"})["error"]}
        for t in ran
        if up.get(t, {}).get("outcome") == "passed" and ours.get(t, {}).get("outcome") != "passed"
    ]
    return {
        "suite": suite,
        "ran": sum(1 for t in ran if up.get(t, {}).get("outcome") not in (None, "skipped")),
        "skipped_upstream": sum(1 for t in ran if up.get(t, {}).get("outcome") == "skipped"),
        "pass_upstream": sum(1 for t in ran if up.get(t, {}).get("outcome") == "passed"),
        "pass_ours": sum(1 for t in ran if ours.get(t, {}).get("outcome") == "passed"),
        "pass_upstream_fail_ours": regressions,
        "fail_upstream_pass_ours": [
            t
            for t in ran
            if up.get(t, {}).get("outcome") == "failed" and ours.get(t, {}).get("outcome") == "passed"
        ],
        "seconds": {b: r["seconds"] for b, r in runs.items()},
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", nargs="?", choices=sorted(SUITES))
    ap.add_argument("paths", nargs="*", help="the copied test files (outside this repository)")
    ap.add_argument("--nproc", type=int, default=1, help="ranks (torch.distributed.run, gloo on the CPU)")
    ap.add_argument("--json", help="write the summary here (atomically)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--binding", choices=("upstream", "ours"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.suite, args.binding, args.paths, extra, args.out)
    if args.suite is None:
        ap.print_help()
        return 2
    if SUITES[args.suite]["kind"] == "pytest" and not args.paths:
        ap.error(f"{args.suite}: name the copied test files")
    # SIGTERM as Ctrl-C: the running child's process group is stopped before the exit
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    summary = summarise(args.suite, run_twice(args.suite, args.paths, extra, args.nproc))
    print(f"\n{args.suite}: ran {summary['ran']}, pass upstream {summary['pass_upstream']}, "
          f"pass with ours {summary['pass_ours']} (skipped upstream: {summary['skipped_upstream']})")  # fmt: skip
    for r in summary["pass_upstream_fail_ours"]:
        print(f"  passes upstream, fails with ours: {r['test']}\n      {r['error']}")
    for t in summary["fail_upstream_pass_ours"]:
        print(f"  fails upstream, passes with ours: {t}")
    if args.json:
        tmp = f"{args.json}.tmp"
        Path(tmp).write_text(json.dumps(summary, indent=1) + "\n")
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
