"""benchmarks/reproduce: each benchmark's command, the README tables, and the CI subset of the
SST-2 and language-model benchmarks run for real (real MiniLM-L6, real ../shared/data, a few steps)."""

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_data import DATA, needs_data

ROOT = Path(__file__).resolve().parents[1]
REPRO = ROOT / "benchmarks" / "reproduce"


def load(name):
    spec = importlib.util.spec_from_file_location(f"reproduce_{name}", REPRO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run, table = load("run"), load("table")


def options(**kw):
    base = dict(
        quick=False,
        data_dir=str(DATA),
        seeds=[0, 1],
        settings=None,
        output_dir=None,
        reuse_finished=False,
        max_steps=None,
        launch_config=None,
    )
    return argparse.Namespace(**{**base, **kw})


def value(command, flag):
    return command[command.index(flag) + 1]


@needs_data
@pytest.mark.parametrize("name", list(run.BENCHMARKS))
def test_every_benchmark_runs_offline_from_shared_data(name):
    bench = run.BENCHMARKS[name]
    command = run.build_command(name, options(), [])
    runner, script = command[: command.index("--")], command[command.index("--") + 1 :]
    assert runner[1] == str(ROOT / bench["recipe"]) and Path(runner[1]).is_file()
    assert value(runner, "--max_steps") == str(bench["steps"])
    assert runner[runner.index("--seeds") + 1 : runner.index("--seeds") + 3] == ["0", "1"]
    assert value(runner, "--settings") == bench["settings"]
    assert ("--first_seed_only" in runner) == ("static" in bench["settings"])
    assert Path(value(script, "--model_name_or_path")).is_dir()
    for flag in ("--train_file", "--validation_file"):
        if flag in script:
            path = Path(value(script, flag))
            assert path.is_file(), f"{path} is missing: see ../shared/data/README.md"
    flags = [a for a in script if a.startswith("--")]
    assert len(flags) == len(set(flags)), "a recipe flag given twice"


@needs_data
def test_sst2_is_one_epoch_of_the_full_train_split():
    bench = run.BENCHMARKS["sst2"]
    rows = sum(1 for _ in open(DATA / "sst2" / "train.tsv")) - 1  # header
    batch = int(value(bench["args"], "--per_device_train_batch_size"))
    assert rows == 67349 and bench["steps"] == -(-rows // batch)


def test_network_flags_replace_local_data_and_model():
    extra = ["--model_name_or_path", "bert-base-uncased", "--dataset_name", "nyu-mll/glue",
             "--dataset_config_name", "sst2", "--learning_rate", "2e-5"]  # fmt: skip
    script = (command := run.build_command("sst2", options(), extra))[command.index("--") + 1 :]
    assert "--train_file" not in script and "--validation_file" not in script
    assert (
        script.count("--model_name_or_path") == 1
        and value(script, "--model_name_or_path") == "bert-base-uncased"
    )
    assert script.count("--learning_rate") == 1 and value(script, "--learning_rate") == "2e-5"


def test_quick_is_one_seed_and_a_few_steps():
    command = run.build_command("wikitext2-clm", options(quick=True, output_dir="x"), [])
    script = command[command.index("--") + 1 :]
    assert value(command, "--max_steps") == str(run.BENCHMARKS["wikitext2-clm"]["quick"]["steps"])
    assert command[command.index("--seeds") + 2] == "--max_steps"  # one seed
    assert (
        script.count("--gradient_accumulation_steps") == 1
        and value(script, "--gradient_accumulation_steps") == "2"
    )


def synthetic(accuracies):
    runs = [
        {"setting": s, "seed": seed, "fp16": None if s == "fp32" else "emulated", "status": "ok",
         "final_eval": {"eval_accuracy": acc, "eval_loss": 0.3}, "evals": [], "skipped_steps": None if s == "fp32" else 1,
         "total_steps": 100, "final_scale": None if s == "fp32" else 2.0**15, "flushed_start": None if s == "fp32" else 0.002,
         "flushed_end": None if s == "fp32" else 3e-6, "overflow_end": False, "train_runtime_s": 60.0, "wall_s": 90.0,
         "command": []}
        for s, accs in accuracies.items() for seed, acc in enumerate(accs)
    ]  # fmt: skip
    return {"benchmark": "sst2", "what": "SST-2", "command": "hf-lossscale compare ...", "wall_s": 600.0,
            "machine": "test", "summary": {}, "runs": runs}  # fmt: skip


def test_table_verdicts_are_paired():
    """FP32 accuracies spread by 3 points, scaling off 0.4-0.6 points lower at every seed: the old
    'within FP32's spread' rule passed it; paired over three seeds it is worse."""
    result = synthetic(
        {"fp32": [0.900, 0.930, 0.915], "dynamic": [0.901, 0.929, 0.915], "off": [0.895, 0.924, 0.911]}
    )
    found = {v["setting"]: v for v in table.verdicts(result)}
    assert found["off"]["verdict"] == "worse" and found["off"]["gaps"] == pytest.approx(
        [-0.005, -0.006, -0.004]
    )
    assert found["dynamic"]["verdict"] == "no measurable difference"
    two = {v["setting"]: v for v in table.verdicts(synthetic({"fp32": [0.88, 0.91], "off": [0.85, 0.88]}))}
    assert two["off"]["verdict"] == "too few seeds"


def test_bf16_is_judged_against_fp32_and_against_fp16_dynamic():
    """BF16 gets the paired verdict against FP32 like every setting, and its own line against FP16
    + dynamic scaling (the choice a user makes), gaps BF16 - FP16 per seed. Bug caught: BF16 left
    out of the verdicts, or set against FP32 where the line says FP16."""
    result = synthetic({
        "fp32": [0.900, 0.930, 0.915], "dynamic": [0.901, 0.929, 0.915], "bf16": [0.896, 0.926, 0.910],
    })  # fmt: skip
    found = {v["setting"]: v for v in table.verdicts(result)}
    assert found["bf16"]["verdict"] == "worse" and found["bf16"]["gaps"] == pytest.approx(
        [-0.004, -0.004, -0.005]
    )
    against = table.bf16_against_dynamic(result)
    assert against["gaps"] == pytest.approx([-0.005, -0.003, -0.005]) and against["verdict"] == "worse"
    text = table.render(result)
    assert (
        "- BF16 against FP16 + dynamic scaling: paired accuracy (%) gap (BF16 - FP16) -0.50, -0.30, -0.50"
        in text
    )
    assert "**BF16 worse**" in text
    assert (
        table.bf16_against_dynamic(synthetic({"fp32": [0.9], "bf16": [0.9]})) is None
    )  # no FP16 run: no line


def test_table_rows_and_readme_block(tmp_path):
    result = synthetic({"fp32": [0.900, 0.905], "dynamic": [0.902, 0.899], "off": [0.880, 0.885]})
    text = table.render(result)
    rows = [line for line in text.splitlines() if line.startswith("| FP")]
    assert len(rows) == 6 and rows[0].startswith("| FP32 | — | 0 | 90.00 | 0.3000 |")
    assert "| 1/100 | 2^15 | 0.20% | 3.0e-04% | 1.5 min |" in rows[2]
    assert "FP16, scaling off: paired accuracy (%) gap to FP32 -2.00, -2.00 (seeds 0, 1)" in text
    assert "**no verdict (2 seeds; the rule needs 3)**" in text
    (tmp_path / "sst2.json").write_text(json.dumps(result))
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{table.START}\nold\n{table.END}\nafter\n")
    table.write_readme(readme, table.render_tables(tmp_path))
    written = readme.read_text()
    assert written.startswith("intro\n") and written.endswith(f"{table.END}\nafter\n")
    assert "old" not in written and "| FP16, scaling off | emulated | 1 | 88.50 |" in written
    headline = table.render_headline(tmp_path)
    assert (
        "| `sst2` | accuracy % | 90.00 / 90.50 | 90.20 / 89.90 (2/200 steps skipped) (2 seeds: no verdict) | "
        in headline
    )
    assert "95% Student-t interval" in headline
    assert "static" not in headline.splitlines()[0]  # no benchmark ran it: no empty column
    with_static = synthetic({"fp32": [0.900], "static": [0.500]})
    (tmp_path / "wikitext2-mlm.json").write_text(json.dumps({**with_static, "benchmark": "wikitext2-mlm"}))
    header, _, sst2_row, static_row = table.render_headline(tmp_path).splitlines()[:4]
    assert header.endswith("| FP16 + static scale 2^24 |")
    assert sst2_row.endswith("| — |") and "| 50.00 (1/100 steps skipped) |" in static_row
    readme.write_text("no markers")
    with pytest.raises(SystemExit, match="results:start"):
        table.write_readme(readme, "x")


def quick(name, tmp_path, *extra):
    """`run.py NAME --quick`: its metrics.json; and the results file it must leave alone."""
    out, results = tmp_path / name, REPRO / "results" / f"{name}.json"
    before = results.read_bytes() if results.exists() else None
    proc = subprocess.run(
        [sys.executable, str(REPRO / "run.py"), name, "--quick", "--output_dir", str(out), "--data_dir", str(DATA), *extra],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (results.read_bytes() if results.exists() else None) == before
    return json.loads((out / "metrics.json").read_text())


@needs_data
def test_sst2_ci_subset(tmp_path):
    """The SST-2 benchmark's own command, a few steps on the real data and model, one seed."""
    metrics = quick("sst2", tmp_path)
    runs = {r["setting"]: r for r in metrics["runs"]}
    assert sorted(runs) == ["dynamic", "fp32", "off"]
    for setting, r in runs.items():
        assert r["status"] == "ok" and 0.0 <= r["final_eval"]["eval_accuracy"] <= 1.0
        assert r["fp16"] == (None if setting == "fp32" else "emulated")
    assert runs["dynamic"]["skipped_steps"] == 0 and runs["off"]["final_scale"] == 1.0
    assert (
        runs["off"]["flushed_start"]["flushed_fraction"]
        > runs["dynamic"]["flushed_start"]["flushed_fraction"]
    )


@needs_data
def test_language_model_ci_subset(tmp_path):
    """WikiText-2, MiniLM as a causal LM: the four settings (static on request: the long benchmark
    leaves its storm to the demo), a few steps each."""
    metrics = quick("wikitext2-clm", tmp_path, "--settings", "fp32,dynamic,static,off")
    runs = {r["setting"]: r for r in metrics["runs"]}
    assert sorted(runs) == ["dynamic", "fp32", "off", "static"]
    assert all(r["status"] == "ok" for r in runs.values())
    assert runs["static"]["skipped_steps"] > 0  # 2^24 overflows FP16
    assert runs["off"]["flushed_start"]["flushed_fraction"] > 0.0


def test_lm_benchmarks_are_long_enough_for_a_paired_verdict():
    for name in run.BENCHMARKS:
        if name == "sst2":
            continue
        command = run.build_command(name, options(seeds=None), [])
        runner, script = command[: command.index("--")], command[command.index("--") + 1 :]
        seeds = runner[runner.index("--seeds") + 1 : runner.index("--max_steps")]
        tokens = int(value(script, "--block_size")) * int(value(script, "--per_device_train_batch_size"))
        tokens *= int(value(script, "--gradient_accumulation_steps"))
        assert len(seeds) >= 3 and tokens >= 2048, name
        assert int(value(runner, "--max_steps")) >= (30 if tokens >= 16384 else 100), name


def test_per_seed_streams_merge_into_one_results_file(tmp_path):
    """Two streams of one benchmark add up; a changed configuration replaces the old runs."""
    path = tmp_path / "b.json"

    def stream(seed, lr="2e-4"):
        result = synthetic({"fp32": [0.9], "off": [0.89]})
        for r in result["runs"]:
            r["seed"] = seed
        result["command"] = (
            f"hf-lossscale compare x --seeds {seed} --output_dir runs/s{seed} -- --learning_rate {lr}"
        )
        result["run_command"] = f"python benchmarks/reproduce/run.py b --seeds {seed}"
        return result

    run.merge_results(path, stream(1))
    run.merge_results(path, stream(0))
    merged = json.loads(path.read_text())
    assert sorted((r["seed"], r["setting"]) for r in merged["runs"]) == [
        (0, "fp32"),
        (0, "off"),
        (1, "fp32"),
        (1, "off"),
    ]
    assert merged["run_command"] == "python benchmarks/reproduce/run.py b --seeds 0 1 --settings fp32,off"
    assert merged["wall_s"] == 1200.0
    run.merge_results(path, stream(0))  # the same seed again replaces its runs, keeps the other seed's
    assert len(json.loads(path.read_text())["runs"]) == 4
    run.merge_results(path, stream(2, lr="1e-3"))  # another configuration: the old runs go
    assert {r["seed"] for r in json.loads(path.read_text())["runs"]} == {2}


def test_streams_from_two_checkouts_merge(tmp_path):
    """The same benchmark run from two clones (a worktree per stream): the recipe's path differs only
    in the checkout's root, so the runs add up; a path outside the checkouts that differs (another
    data file) is another configuration. Bug caught: a stream from a second checkout replacing the
    first one's finished runs (hours of CPU lost), or two data files taken for one configuration."""
    path = tmp_path / "b.json"

    def stream(seed, root, data="/data/train.txt"):
        result = synthetic({"fp32": [0.9]})
        for r in result["runs"]:
            r["seed"] = seed
        result["command"] = (
            f"hf-lossscale compare {root}/recipes/language_modeling.py --seeds {seed} "
            f"--output_dir runs/s{seed} -- --train_file {data}"
        )
        result["root"] = root
        result["run_command"] = f"python benchmarks/reproduce/run.py b --seeds {seed}"
        return result

    run.merge_results(path, stream(0, "/work/main"))
    run.merge_results(path, stream(1, "/work/streams/wt1"))
    assert sorted(r["seed"] for r in json.loads(path.read_text())["runs"]) == [0, 1]
    run.merge_results(path, stream(2, "/work/streams/wt2", data="/other/train.txt"))
    assert [r["seed"] for r in json.loads(path.read_text())["runs"]] == [2]


def test_streams_of_other_settings_merge_too(tmp_path):
    """A stream that runs only some settings of the same configuration adds its runs."""
    path = tmp_path / "b.json"
    for settings, seed in (("fp32,off", 0), ("dynamic", 0)):
        result = synthetic({s: [0.9] for s in settings.split(",")})
        for r in result["runs"]:
            r["seed"] = seed
        result["command"] = (
            f"hf-lossscale compare x --settings {settings} --seeds {seed} -- --learning_rate 1e-3"
        )
        result["run_command"] = f"python benchmarks/reproduce/run.py b --settings {settings} --seeds {seed}"
        run.merge_results(path, result)
    merged = json.loads(path.read_text())
    assert sorted(r["setting"] for r in merged["runs"]) == ["dynamic", "fp32", "off"]
    # the published command reruns every setting held, not the last stream's (a BF16-only stream
    # merged into FP32/FP16 runs must not advertise a command that makes BF16 alone)
    assert (
        merged["run_command"] == "python benchmarks/reproduce/run.py b --settings fp32,dynamic,off --seeds 0"
    )


def test_merged_reproduction_command_keeps_every_argument():
    """Issue 30: merging seed streams rewrote the command by cutting at `--seeds`, dropping
    `--max_steps 30` after it and everything after `--`. Bug caught: the published command
    reproducing another run than the one made."""
    run = load("run")
    command = "python benchmarks/reproduce/run.py sst2 --seeds 1 --max_steps 30 -- --learning_rate 1e-4"
    assert run.with_seeds(command, [0, 1, 2]) == (
        "python benchmarks/reproduce/run.py sst2 --seeds 0 1 2 --max_steps 30 -- --learning_rate 1e-4"
    )
    assert (
        run.with_seeds("python run.py sst2 -- --seeds 7", [0]) == "python run.py sst2 --seeds 0 -- --seeds 7"
    )


def test_terminating_the_runner_stops_its_child(tmp_path):
    """Issue 30: `kill -TERM` of `hf-lossscale compare` orphaned the training process it had started.
    Bug caught: a child left running (and writing into a folder the next runner deletes)."""
    import os
    import signal
    import time

    script = tmp_path / "sleepy.py"
    pidfile = tmp_path / "child.pid"
    script.write_text(
        f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(120)\n"
    )
    runner = subprocess.Popen(
        [sys.executable, "-m", "hf_lossscale.tools.cli", "compare", str(script), "--settings", "fp32", "--seeds", "0",
         "--max_steps", "1", "--output_dir", str(tmp_path / "out")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.time() + 60
    while not pidfile.exists() and time.time() < deadline:
        time.sleep(0.2)
    assert pidfile.exists(), "the runner never started its child"
    time.sleep(0.5)
    child = int(pidfile.read_text())
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(60) != 0
    time.sleep(0.5)
    try:
        os.kill(child, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    if alive:  # a zombie the test's process does not own reads as alive: check its state
        state = (
            Path(f"/proc/{child}/stat").read_text().split()[2]
            if Path(f"/proc/{child}/stat").exists()
            else "X"
        )
        alive = state not in ("Z", "X")
    assert not alive
    assert not (tmp_path / "out" / ".hf_lossscale.lock").exists()


def test_simulated_benchmark_is_judged_against_the_fp32_it_simulates(tmp_path):
    """`shakespeare-scratch-1m` (gradients divided by 256) holds FP32 at seed 0 only and FP16 runs at
    three seeds: its verdicts pair each seed with `shakespeare-scratch`'s FP32 run at that seed, and
    its own FP32 run is reported as what the divisor changes. Bugs caught: a simulated benchmark
    judged on its own one FP32 seed (no verdict), FP32 borrowed from another seed, the divided
    FP32 run counted as the baseline."""
    base = synthetic({"fp32": [4.78, 4.77, 4.79]})
    base["benchmark"] = "shakespeare-scratch"
    sim = synthetic({"fp32": [4.781], "off": [6.7, 6.6, 6.8], "dynamic": [4.79, 4.78, 4.80]})
    sim["benchmark"] = "shakespeare-scratch-1m"
    for result in (base, sim):
        for r in result["runs"]:
            r["final_eval"] = {"eval_loss": r["final_eval"]["eval_accuracy"]}
        (tmp_path / f"{result['benchmark']}.json").write_text(json.dumps(result))
    loaded = table.load(tmp_path / "shakespeare-scratch-1m.json")
    found = {v["setting"]: v for v in table.verdicts(loaded)}
    assert found["off"]["n"] == 3 and found["off"]["gaps"] == pytest.approx([1.92, 1.83, 2.01])
    assert found["off"]["verdict"] == "worse" and found["dynamic"]["gaps"] == pytest.approx(
        [0.01, 0.01, 0.01]
    )
    text = table.render(loaded)
    assert "FP32 is `shakespeare-scratch`'s" in text and "FP32, gradients divided against it" in text
    assert "+0.0010" in text  # 4.781 - 4.78, the divisor's own effect at seed 0
    # a benchmark that simulates nothing is loaded as written
    assert table.load(tmp_path / "shakespeare-scratch.json") == json.loads(
        (tmp_path / "shakespeare-scratch.json").read_text()
    )


def test_gpu_master_runs_get_their_own_table(tmp_path):
    """A results file whose FP16 ran on CUDA, with master and pure runs, goes to the master-weights
    table (with its verdicts) and stays out of the CPU headline. Bugs caught: GPU rows mixed into a
    table headed "measured on this CPU", or the master/pure settings left without a verdict."""
    import json

    cpu = synthetic({"fp32": [0.90, 0.93, 0.915], "dynamic": [0.901, 0.929, 0.915]})
    gpu = synthetic({"fp32": [0.90, 0.93, 0.915], "master": [0.899, 0.931, 0.915], "pure": [0.5, 0.5, 0.5]})
    for r in gpu["runs"]:
        r["fp16"] = None if r["setting"] in ("fp32", "pure") else "cuda"
    gpu["benchmark"], gpu["machine"] = "sst2-gpu", "x86_64, NVIDIA H200"
    for name, result in (("sst2", cpu), ("sst2-gpu", gpu)):
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    headline, masters = table.render_headline(tmp_path), table.render_masters(tmp_path)
    assert "`sst2`" in headline and "`sst2-gpu`" not in headline
    assert "`sst2-gpu`" in masters and "`sst2` " not in masters and "NVIDIA H200" in masters
    row = next(line for line in masters.splitlines() if line.startswith("| `sst2-gpu`"))
    master, pure = row.split(" | ")[-2:]
    assert master.endswith("(no measurable difference)") and pure.endswith("(slowed) |"), row
