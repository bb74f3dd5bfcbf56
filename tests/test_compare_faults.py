"""The fault suite of `hf-lossscale compare` (issue 47): a comparison never reports a run it did not
finish, never reuses a stale one, and leaves no training behind it.

The runs here are `tests/scripts/fake_train.py` (the event log a `LossScaleTrainer` writes, in
milliseconds, no torch) under `--launcher python`, so the trials are many and the suite is fast.
Kill -9 of a real Trainer mid-run and mid-checkpoint-save, then a resume, is in
`tests/test_crash_resume.py` (bitwise resumes at random steps and at every point of a save).
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_lossscale.tools.files import DirectoryLock

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "scripts" / "fake_train.py"
SETTINGS = "fp32,dynamic"


def compare_cmd(out, *extra, script_args=(), max_steps=4, settings=SETTINGS):
    return [
        sys.executable, "-m", "hf_lossscale.tools.cli", "compare", str(FAKE), "--launcher", "python",
        "--settings", settings, "--max_steps", str(max_steps), "--output_dir", str(out), "--no_flushed_probe",
        *extra, "--", *script_args,
    ]  # fmt: skip


def compare(out, *extra, env=None, **kw):
    proc = subprocess.run(
        compare_cmd(out, *extra, **kw), capture_output=True, text=True, env={**os.environ, **(env or {})},
        timeout=120,
    )  # fmt: skip
    return proc


def metrics(out):
    return {r["setting"]: r for r in json.loads((out / "metrics.json").read_text())["runs"]}


def processes_mentioning(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if marker in line and "ps -eo" not in line]


def wait_gone(marker: str, within_s: float) -> list[str]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        left = processes_mentioning(marker)
        if not left:
            return []
        time.sleep(0.2)
    return processes_mentioning(marker)


# ---------------------------------------------------------------------- 1. no orphans
@pytest.mark.parametrize(
    "sig", [signal.SIGHUP, signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name
)
def test_a_signal_to_compare_leaves_no_training(tmp_path, sig):
    """Two jobs, each a launcher with a training child (as `accelerate launch`), signalled mid-run.
    Bug caught: SIGHUP (a closed terminal) and SIGKILL (the OOM killer) left the training running
    with parent pid 1; the next comparison into the folder deleted the run folder, the orphan
    recreated it and appended its steps into the new run's log (steps 317, 318, 1, 319, 2, ...)."""
    out = tmp_path / "cmp"
    cmd = compare_cmd(out, "--jobs", "2", script_args=["--spawn", "--step_s", "0.05"], max_steps=400)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    runs = out / "runs"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if len(list(runs.glob("*/loss_scale_log.jsonl")) if runs.exists() else []) >= 2:
            break
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    time.sleep(random.uniform(0.0, 0.5))  # a random moment of the runs
    assert len(processes_mentioning(str(out))) >= 4  # two launchers, two training processes
    proc.send_signal(sig)
    proc.wait(timeout=30)
    assert proc.returncode == (-sig if sig == signal.SIGKILL else 128 + sig)
    left = wait_gone(str(out), within_s=10)  # the watcher: SIGTERM, SIGKILL 5 s later at worst
    assert left == [], left
    # The next comparison into the same folder runs clean: every log holds one run, in order.
    again = compare(out, "--jobs", "2")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    for setting, run in metrics(out).items():
        assert run["status"] == "ok" and run["steps"] == [1, 2, 3, 4], (setting, run["steps"])


def test_a_folder_with_earlier_training_still_running_is_not_taken_over(tmp_path, monkeypatch):
    """Bug caught: a runner took over the folder (the lock's owner was dead) and deleted the run
    folder while the dead runner's training still wrote there."""
    import argparse

    from hf_lossscale.tools import compare as compare_mod
    from hf_lossscale.tools import runner

    out = tmp_path / "cmp"
    run_dir = out / "runs" / "fp32-seed0"
    run_dir.mkdir(parents=True)
    # a stand-in for the dead runner's training, writing in the run's folder
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--output_dir", str(run_dir)],
                              start_new_session=True)  # fmt: skip
    try:
        (run_dir / ".hf_lossscale.pgid").write_text(str(orphan.pid))
        (run_dir / "loss_scale_log.jsonl").write_text("")
        monkeypatch.setattr(runner, "EARLIER_RUNS_WAIT_S", 0.5, raising=False)
        opts = argparse.Namespace(
            script=str(FAKE), settings=SETTINGS, seeds=[0], max_steps=4, output_dir=str(out),
            static_scale=2.0**24, fp16_on_cpu="emulate", launcher="python", launch_config=None,
            first_seed_only="", reuse_finished=False, jobs=1, dynamic_init_scale=None,
            dynamic_growth_interval=None, flushed_probe=False, script_args=[],
        )  # fmt: skip
        with pytest.raises(SystemExit, match=f"still runs.*process group {orphan.pid}"):
            compare_mod.run_comparison(opts)
        assert (run_dir / "loss_scale_log.jsonl").exists()  # not deleted under it
        unrelated = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a recycled process id
        try:
            (run_dir / ".hf_lossscale.pgid").write_text(str(unrelated.pid))
            assert runner.live_run_group(run_dir) is None
        finally:
            unrelated.kill()
            unrelated.wait()
    finally:
        orphan.kill()
        orphan.wait()


# ---------------------------------------------------------------------- 2. reuse what finished
def test_reuse_reruns_a_truncated_log_at_every_cut(tmp_path):
    """`--reuse_finished` on a run whose event log was cut at each line boundary: never reused.
    Bug caught: only run.json was checked; a cut log was reported as final with status ok (its gap an
    artefact of an intermediate eval), or, with every eval cut, as FAILED (exit 0) and never rerun."""
    out = tmp_path / "cmp"
    first = compare(out)
    assert first.returncode == 0, first.stderr[-2000:]
    run_dir = out / "runs" / "dynamic-seed0"
    log = run_dir / "loss_scale_log.jsonl"
    full = log.read_bytes()
    lines = full.splitlines(keepends=True)
    # End to end, both cuts the probe found: the run is rerun, saying why in one line, and the
    # table holds the full run.
    for keep in (
        lambda line: b"run_end" not in line and b'"step": 4' not in line,  # the final eval cut
        lambda line: b"run_end" not in line and b"eval_loss" not in line,
    ):  # every eval cut
        log.write_bytes(b"".join(line for line in lines if keep(line)))
        again = compare(out, "--reuse_finished")
        assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
        assert "[dynamic seed 0] rerunning: its event log has no run_end (cut short)" in again.stdout
        assert "[   fp32 seed 0] reusing the finished run" in again.stdout
        assert log.read_bytes() == full
        assert metrics(out)["dynamic"]["status"] == "ok"
    # Every whole-line cut, and a cut inside each line: never reusable.
    from hf_lossscale.tools.runner import reuse_problem, run_inputs

    record = json.loads((run_dir / "run.json").read_text())
    command, max_steps = record["command"], 4
    inputs = run_inputs(command, {**os.environ, "PYTHONUNBUFFERED": "1"}, own=run_dir)
    assert reuse_problem(run_dir, command, inputs, max_steps) is None
    trials = 0
    for cut in range(len(lines)):
        for data in (b"".join(lines[:cut]), b"".join(lines[:cut]) + lines[cut][: len(lines[cut]) // 2]):
            log.write_bytes(data)
            assert reuse_problem(run_dir, command, inputs, max_steps) is not None, data
            trials += 1
    assert trials == 2 * len(lines)


def test_a_fresh_run_that_exits_0_with_a_cut_log_is_not_ok(tmp_path):
    """Exit 0 is not a finished run: the log must reach run_end at --max_steps. Bug caught: a run
    that stopped at step 2 with exit 0 was in the table as ok, with its mid-run eval as final."""
    out = tmp_path / "cmp"
    proc = compare(out, script_args=["--stop_at", "2"])
    assert proc.returncode == 1
    assert "exit 0, but its event log has no run_end (cut short)" in proc.stderr
    assert {r["status"] for r in metrics(out).values()} == {"failed"}
    assert "Left out of every verdict" in (out / "summary.md").read_text()


@pytest.mark.parametrize("change", ["config_file", "env"])
def test_reuse_reruns_when_an_input_changed(tmp_path, change):
    """Bug caught: the record held only the command; a changed --config file or HF_LOSSSCALE_*
    variable reused the old runs and the final scale stayed 2^16 where a fresh run gives 2^3."""
    out = tmp_path / "cmp"
    config = tmp_path / "run.yaml"
    config.write_text("init_scale: 65536\n")
    first = compare(out, script_args=["--config", str(config)] if change == "config_file" else [])
    assert first.returncode == 0, first.stderr[-2000:]
    assert metrics(out)["dynamic"]["final_scale"] == 2.0**16
    env = {}
    if change == "config_file":
        config.write_text("init_scale: 8\n")
    else:
        env = {"HF_LOSSSCALE_INIT_SCALE": "8"}
    again = compare(out, "--reuse_finished", env=env,
                    script_args=["--config", str(config)] if change == "config_file" else [])  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    why = "changed" if change == "config_file" else "HF_LOSSSCALE_INIT_SCALE"
    assert "[dynamic seed 0] rerunning: its inputs changed: " in again.stdout and why in again.stdout
    assert metrics(out)["dynamic"]["final_scale"] == 8.0
    record = json.loads((out / "runs" / "dynamic-seed0" / "run.json").read_text())
    assert record["loss_scale_config"] == {"init_scale": 8.0}


def test_a_malformed_run_record_is_rerun_not_a_crash(tmp_path):
    """Bug caught: a run.json lacking wall_s (or not an object) crashed the comparison."""
    out = tmp_path / "cmp"
    assert compare(out).returncode == 0
    run_dir = out / "runs" / "dynamic-seed0"
    record_path = run_dir / "run.json"
    record = json.loads(record_path.read_text())
    record_path.write_text(json.dumps({k: v for k, v in record.items() if k != "wall_s"}))
    again = compare(out, "--reuse_finished")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "[dynamic seed 0] rerunning: its run.json is unreadable ('wall_s')" in again.stdout
    from hf_lossscale.tools.runner import reuse_problem, run_inputs

    record = json.loads(record_path.read_text())
    inputs = run_inputs(record["command"], {**os.environ}, own=run_dir)
    for bad in ("{not json", "[1, 2]", "null", json.dumps({**record, "wall_s": "soon"})):
        record_path.write_text(bad)
        assert reuse_problem(run_dir, record["command"], inputs, 4).startswith("its run.json is unreadable")


# ---------------------------------------------------------------------- 3. atomic lock and outputs
CONTENDERS = 6


def _contender(folder, barrier, holders, overlaps, jitter_s):
    barrier.wait()
    time.sleep(jitter_s)  # spread the starts: some contender reads the stale owner while another links
    try:
        with DirectoryLock(folder):
            with holders.get_lock():
                holders.value += 1
                if holders.value > 1:
                    overlaps.value += 1
            time.sleep(0.03)
            with holders.get_lock():
                holders.value -= 1
    except Exception:
        pass


def test_stale_lock_takeover_is_atomic(tmp_path):
    """A lock left by a dead runner, six runners at once, many trials: never two holders.
    Bug caught: read owner, unlink, link is not atomic; two runners both held it in 29 of 300."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    holders, overlaps = ctx.Value("i", 0), ctx.Value("i", 0)
    trials = int(os.environ.get("LOCK_TRIALS", 100))
    for trial in range(trials):
        folder = tmp_path / f"t{trial}"
        folder.mkdir()
        (folder / DirectoryLock.NAME).write_text(str(dead.pid))
        barrier = ctx.Barrier(CONTENDERS)
        procs = [ctx.Process(target=_contender, args=(folder, barrier, holders, overlaps, random.uniform(0, 0.003)))
                 for _ in range(CONTENDERS)]  # fmt: skip
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
    assert overlaps.value == 0, f"two holders at once in {overlaps.value} of {trials} trials"


def test_a_file_size_limit_during_the_outputs_leaves_the_previous_set(tmp_path):
    """The outputs are published as a set: with a file-size limit that the plots exceed, the folder
    keeps the previous summary, plots and metrics, and the error is one line.
    Bug caught: summary.md was replaced, then a plot was cut and metrics.json was the previous
    comparison's."""
    out = tmp_path / "cmp"
    assert compare(out).returncode == 0
    names = ["summary.md", "metrics.json", "eval_loss.png", "gap.png", "loss_scale.png"]
    before = {n: (out / n).read_bytes() for n in names}
    limit = 16_000
    assert len(before["summary.md"]) < limit < max(len(before[n]) for n in names if n.endswith(".png"))
    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
        "from hf_lossscale.tools.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    cmd = compare_cmd(out, "--reuse_finished")
    proc = subprocess.run([sys.executable, "-c", code, *cmd[3:]], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "File too large" in err[0] and "unchanged" in err[0], proc.stderr[-3000:]
    assert {n: (out / n).read_bytes() for n in names} == before
    assert not [p for p in out.iterdir() if p.name.startswith(".") and p.name != DirectoryLock.NAME]


def test_outputs_are_readable_by_others(tmp_path):
    """Bug caught: summary.md, metrics.json and run.json were created 0600 (mkstemp's mode)."""
    from hf_lossscale.tools.files import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644


# ---------------------------------------------------------------------- 4. bounded, named errors
BOMB = "\n".join(
    [
        'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]',
        *[f"{c}: &{c} [{','.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefg", "bcdefgh")],
        "init_scale: *h",
    ]
)


def test_yaml_alias_bomb_and_dev_zero_are_refused_fast(tmp_path):
    """Bug caught: 376 bytes of nested aliases cost 6 s and 610 MB, and the error quoted the expanded
    value (312 million characters); `HF_LOSSSCALE_CONFIG=/dev/zero` read until a MemoryError."""
    from hf_lossscale.core.config import config_from_env, read_config_file

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    assert len(BOMB) < 600
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="aliases expand to more than") as err:
        config_from_env({"HF_LOSSSCALE_CONFIG": str(bomb)})
    assert len(str(err.value)) < 500
    with pytest.raises(ValueError, match="over 1048576 bytes"):
        config_from_env({"HF_LOSSSCALE_CONFIG": "/dev/zero"})
    recursive = tmp_path / "rec.yaml"
    recursive.write_text("a: &a [*a]\n")
    with pytest.raises(ValueError, match="bomb|recursive|Cannot parse"):
        read_config_file(recursive)
    assert time.monotonic() - t0 < 2


def test_yaml_merge_override_is_yaml_not_a_duplicate(tmp_path):
    """Bug caught: `<<: *d` then `hysteresis: 3` was refused as a duplicate key; a key given twice
    outside a merge still is."""
    from hf_lossscale.core.config import read_config_file

    path = tmp_path / "c.yaml"
    path.write_text("d: &d\n  init_scale: 8\n  hysteresis: 2\nloss_scale:\n  <<: *d\n  hysteresis: 3\n")
    assert read_config_file(path)["loss_scale"] == {"init_scale": 8, "hysteresis": 3}
    path.write_text("init_scale: 8\ninit_scale: 9\n")
    with pytest.raises(ValueError, match="given twice"):
        read_config_file(path)


def test_a_blank_config_variable_is_refused_as_blank_field_variables_are():
    from hf_lossscale.core.config import config_from_env

    with pytest.raises(ValueError, match="HF_LOSSSCALE_CONFIG is set but empty"):
        config_from_env({"HF_LOSSSCALE_CONFIG": ""})


def test_quoted_values_in_compare_errors_are_capped(tmp_path):
    """A megabyte of --settings is quoted in a few hundred characters."""
    import argparse

    from hf_lossscale.tools.compare import validate

    opts = argparse.Namespace(settings="x" * 1_000_000, script=str(FAKE), seeds=[0], max_steps=1,
                              static_scale=1.0, first_seed_only="", script_args=[])  # fmt: skip
    with pytest.raises(SystemExit) as err:
        validate(opts)
    assert len(str(err.value)) < 1000 and "more characters" in str(err.value)


@pytest.mark.parametrize(
    "content, cause",
    [
        (b"", "is empty"),
        (b"\x00\x01\x02binary\xff\xfe", "NUL bytes"),
        ("some text\nmore\n".encode("utf-16"), "UTF-16"),
        (b"\n" * 500, "only blank lines"),
        (b"caf\xe9 latin-1\n", "not UTF-8"),
    ],
    ids=["empty", "binary", "utf16", "blank", "latin1"],
)
def test_a_bad_train_file_is_named_with_its_cause(tmp_path, content, cause):
    """Bug caught: an empty, binary or UTF-16 --train_file got datasets' DatasetGenerationError naming
    neither the file nor the cause; 500 blank lines trained silently."""
    from hf_lossscale.recipes.recipe_args import ModelArguments, load_raw_datasets

    path = tmp_path / "train.txt"
    path.write_bytes(content)
    data = _data_args(path)
    with pytest.raises(ValueError, match=cause) as err:
        load_raw_datasets(data, ModelArguments(model_name_or_path="x", cache_dir=str(tmp_path / "cache")))
    assert "train.txt" in str(err.value)


def _data_args(path):
    import argparse

    return argparse.Namespace(dataset_name=None, train_file=str(path), validation_file=None,
                              validation_split_percentage=5)  # fmt: skip


def test_one_line_of_text_says_it_is_too_little(tmp_path):
    """Bug caught: one line got sklearn's "the resulting train set will be empty"."""
    from hf_lossscale.recipes.recipe_args import ModelArguments, load_raw_datasets

    path = tmp_path / "train.txt"
    path.write_text("just one line of text\n")
    with pytest.raises(ValueError, match=r"train\.txt.*1 row\(s\): too few to hold out 5%"):
        load_raw_datasets(
            _data_args(path), ModelArguments(model_name_or_path="x", cache_dir=str(tmp_path / "c"))
        )


@pytest.mark.parametrize(
    "line, match",
    [("fp16: 2", "fp16=2 is not true or false"), ("model_name_or_path: {a: 1}", "is a dict"),
     ("output_dir: [a, b]", "output_dir=\\['a', 'b'\\] is a list")],
    ids=["fp16-int", "model-dict", "output-list"],
)  # fmt: skip
def test_recipe_config_values_of_the_wrong_kind_are_named(tmp_path, line, match):
    """Bug caught: the recipe --config accepted `fp16: 2` and a dict for model_name_or_path, and a
    list for output_dir ended in a bare TypeError."""
    from transformers import TrainingArguments

    from hf_lossscale.recipes.recipe_args import ModelArguments, make_parser, parse_args

    path = tmp_path / "run.yaml"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=f"run.yaml.*{match}"):
        parse_args(make_parser(ModelArguments, TrainingArguments), ["--config", str(path), "--output_dir", "o",
                                                                    "--model_name_or_path", "m"])  # fmt: skip


@pytest.mark.parametrize(
    "argv, flag",
    [(["preflight", "--per_device_train_batch_size", "0"], "--per_device_train_batch_size"),
     (["advise", "--steps", "-3"], "--steps")],
    ids=["preflight-batch-0", "advise-steps-neg"],
)  # fmt: skip
def test_counts_of_zero_or_less_are_refused_by_name(argv, flag, tmp_path):
    """Bug caught: `preflight --per_device_train_batch_size 0` raised ZeroDivisionError, `advise
    --steps -3` said "Not enough text" (on a real model and text: the error is the count's)."""
    from tiny_models import save_tiny_bert

    from hf_lossscale.tools.cli import main

    model = save_tiny_bert(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"a line of words number {i} for a tiny model to read" for i in range(200)))
    with pytest.raises(SystemExit, match=f"^{flag} (0|-3): .* needs at least 1"):
        main([*argv, "--model_name_or_path", str(model), "--train_file", str(text), "--objective", "clm"])


def test_report_after_a_resume_plots_the_steps_as_they_stand(tmp_path, monkeypatch):
    """Bug caught: `report` after a resume plotted the discarded attempt (steps 1..8, 6, 7, 8, 9..)."""
    from hf_lossscale.tools import report

    def log(step, **kw):
        return {"event": "log", "step": step, "loss": 1.0 / step, **kw}

    events = [{"event": "run_start", "resumed": False}, *[log(s) for s in range(1, 9)],
              {"event": "log", "step": 8, "eval_loss": 9.0},
              {"event": "run_start", "resumed": True}, *[log(s, resumed=1) for s in range(6, 11)],
              {"event": "log", "step": 10, "eval_loss": 1.0}]  # fmt: skip
    (tmp_path / "loss_scale_log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    plotted = []
    real = report.plot_scale
    monkeypatch.setattr(
        report, "plot_scale", lambda ax, steps, *a, **k: plotted.append(steps) or real(ax, steps, *a, **k)
    )
    report.make_report(tmp_path)
    assert plotted == [list(range(1, 11))]


def test_reuse_help_says_one_comparison_per_folder():
    """Bug caught: the --reuse_finished help described running seeds in parallel into one folder,
    which the lock refuses."""
    from hf_lossscale.tools.cli import make_parser

    compare = make_parser()._subparsers._group_actions[0].choices["compare"]
    text = next(a.help for a in compare._actions if a.dest == "reuse_finished")
    assert "in parallel" not in text and "one comparison per OUTPUT_DIR" in text
