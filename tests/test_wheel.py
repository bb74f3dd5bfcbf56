"""What a wheel install gets: the demo's recipe, the recipes and their metric modules are inside
the package, and the old module paths are in it too."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"pip wheel failed:\n{done.stderr[-2000:]}")
    (wheel,) = out.glob("hf_lossscale-*.whl")
    return set(zipfile.ZipFile(wheel).namelist())


def test_wheel_holds_the_recipes_the_demo_runs(wheel_names):
    """Bugs caught: the demo's recipe outside the package (a wheel install's `hf-lossscale demo`
    refuses), the GLUE metric modules left out as package data (the classification recipe fails at
    its first evaluation), a tier's `__init__` missing (its modules are not packaged)."""
    from hf_lossscale.tools.demo import RECIPE

    assert RECIPE.relative_to(ROOT).as_posix() in wheel_names
    for needed in ("hf_lossscale/recipes/text_classification.py", "hf_lossscale/recipes/recipe_args.py",
                   "hf_lossscale/recipes/metrics/accuracy/accuracy.py", "hf_lossscale/recipes/metrics/f1/f1.py",
                   "hf_lossscale/core/scaler.py", "hf_lossscale/integrations/trainer.py", "hf_lossscale/tools/cli.py",
                   "hf_lossscale/fp16/emulation.py", "hf_lossscale/py.typed"):  # fmt: skip
        assert needed in wheel_names, needed
    assert not any(n.startswith(("tests/", "benchmarks/", "recipes/")) for n in wheel_names)
