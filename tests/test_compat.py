"""Guard: fails loudly when accelerate / transformers change under the integration."""

import importlib
import os
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import torch

from hf_lossscale.integrations.compat import INSTANCE_INTERNALS, INTERNALS, TESTED_VERSIONS, major_minor

LOCK = Path(__file__).resolve().parents[1] / "constraints.txt"


def locked_versions() -> dict[str, str]:
    """constraints.txt as {normalised name: version}; comments and blank lines skipped."""
    out = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, pinned = line.partition("==")
            assert pinned, f"constraints.txt: {line!r} is not an exact pin"
            out[name.strip().lower().replace("_", "-")] = pinned.strip()
    return out


@pytest.mark.parametrize("package", sorted(TESTED_VERSIONS))
def test_lock_holds_the_tested_versions(package):
    """Bug caught: TESTED_VERSIONS raised (or the lock regenerated) without the other, so the pinned
    test environment is not the one the integration's internals were checked against."""
    locked = locked_versions()
    assert package in locked, f"constraints.txt does not pin {package}"
    assert major_minor(locked[package]) == TESTED_VERSIONS[package], (
        f"constraints.txt pins {package} {locked[package]} but hf_lossscale is tested against "
        f"{TESTED_VERSIONS[package]}.x: run `make test` on the new lock, check the internals in "
        "hf_lossscale/integrations/compat.py, then update TESTED_VERSIONS."
    )


def test_lock_is_exact_and_covers_the_test_extras():
    """Bug caught: a dependency added to pyproject but missing from the lock (installed at whatever
    version the registry serves that day, the failure this file exists to prevent)."""
    import tomllib

    locked = locked_versions()
    project = tomllib.loads((LOCK.parent / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = project["dependencies"] + [
        r for name in ("dev", "recipes", "tools", "demo", "docs") for r in extras[name]
    ]
    for requirement in (
        r for r in wanted if not r.startswith("hf_lossscale[")
    ):  # its own extras: listed here
        name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        assert name in locked, f"{name} (from pyproject.toml) is not pinned in constraints.txt"


@pytest.mark.skipif(
    os.environ.get("HF_LOSSSCALE_CHECK_LOCK") != "1",
    reason="set by `make test` and CI, which install constraints.txt; `make test-latest` does not",
)
@pytest.mark.parametrize("package", sorted(TESTED_VERSIONS))
def test_installed_versions_are_the_locked_ones(package):
    from hf_lossscale.integrations.compat import OPTIONAL

    try:
        installed = version(package)
    except PackageNotFoundError:
        if package in OPTIONAL:
            pytest.skip(f"{package} (an optional extra) is not installed")
        raise
    assert installed.split("+")[0] == locked_versions()[package], (
        f"{package} {installed} is installed, constraints.txt pins {locked_versions()[package]}: "
        "`make install-dev` installs the lock"
    )


@pytest.mark.parametrize(("module", "path"), INTERNALS)
def test_internals_exist(module, path):
    obj = importlib.import_module(module)
    for part in path.split("."):
        assert hasattr(obj, part), f"{module}.{path} is gone: the integration relies on it"
        obj = getattr(obj, part)


@pytest.mark.parametrize(("module", "cls", "attribute"), INSTANCE_INTERNALS)
def test_instance_internals_exist(module, cls, attribute):
    """Built as install_loss_scaler meets them: an Accelerator, an optimizer it wraps with a scaler,
    and a model it prepared under autocast."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    builders = {
        # a model Accelerate prepared under autocast (bf16 runs on the CPU; fp16 does the same on CUDA)
        "Linear": lambda: Accelerator(mixed_precision="bf16", cpu=True).prepare_model(torch.nn.Linear(2, 1)),
        "Accelerator": Accelerator,
        "AdamW": lambda: torch.optim.AdamW(torch.nn.Linear(2, 1).parameters(), fused=True),
        "AcceleratedOptimizer": lambda: AcceleratedOptimizer(
            torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1), scaler=torch.amp.GradScaler("cpu")
        ),
    }
    if cls == "AcceleratedOptimizer":
        Accelerator()  # the state AcceleratedOptimizer reads
    obj = builders[cls]()
    assert type(obj).__module__ == module
    assert attribute in vars(obj), f"{module}.{cls}().{attribute} is gone: install_loss_scaler relies on it"


def test_accelerated_optimizer_step_protocol():
    """How Accelerate drives a scaler, observed: `AcceleratedOptimizer.step(closure)` calls
    `scaler.step(optimizer, closure)` then `scaler.update()`, and decides `step_was_skipped` from
    whether the wrapped `optimizer.step` ran (`_accelerate_step_called`), which we replace. Bug
    caught: an accelerate release that drives the scaler differently (say, `update()` inside
    `step()` or unscaling itself first), which would go unnoticed by the integration."""
    from accelerate import Accelerator

    calls = []

    class Recorder:
        def step(self, optimizer, closure=None):
            calls.append(("step", type(optimizer).__name__, closure))
            return None  # skipped: the wrapped optimizer.step never runs

        def update(self):
            calls.append(("update",))

        def get_scale(self):
            return 1.0

    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator()  # the state AcceleratedOptimizer reads
    model = torch.nn.Linear(2, 1)
    optimizer = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=Recorder())

    def closure():
        return None

    optimizer.step(closure)
    assert calls == [("step", "SGD", closure), ("update",)]
    assert optimizer.step_was_skipped is True  # inferred from the wrapped step never being called
    assert optimizer._accelerate_step_called is False  # reset for the next step


def test_trainer_scaler_file_name():
    from transformers.trainer import SCALER_NAME

    assert SCALER_NAME == "scaler.pt"


def test_untested_versions_are_named_once_at_run_time(monkeypatch):
    """Bug caught: an untested accelerate/transformers/torch noticed only by this test file, or a
    warning repeated at every install."""
    import re
    import warnings

    from accelerate import Accelerator

    from hf_lossscale import install_loss_scaler
    from hf_lossscale.integrations import compat as _compat

    # every other package counts as tested, whatever the registry served this machine
    for name in _compat.TESTED_VERSIONS:
        try:
            monkeypatch.setitem(_compat.TESTED_VERSIONS, name, major_minor(version(name)))
        except PackageNotFoundError:  # an optional extra that is not installed
            pass
    monkeypatch.setitem(_compat.TESTED_VERSIONS, "accelerate", "0.1")
    monkeypatch.setattr(_compat, "_warned", False)
    expected = re.escape(f"accelerate {version('accelerate')} (tested: 0.1.x)")
    with pytest.warns(UserWarning, match=expected):
        install_loss_scaler(Accelerator(mixed_precision="fp16"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        install_loss_scaler(Accelerator(mixed_precision="fp16"))  # named once per process
    assert _compat.untested_versions() == {"accelerate": version("accelerate")}


def test_accelerate_4242_gate_matches_the_installed_accelerate():
    """`compat.accelerate_has_4242()` says whether `install_loss_scaler` needs `LossScaledOptimizer`.
    Observed here: a scaler that calls the optimizer's step and skips inside it (as a fused kernel
    does) leaves plain Accelerate's `step_was_skipped` False. Bugs caught: an accelerate release that
    fixes issue 4242 while the gate still swaps classes (set `ACCELERATE_4242_FIXED_IN`), or a gate
    that turns the workaround off on a release that still has the bug (fused skips then read as
    steps: the Trainer would advance its LR schedule on them)."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    from hf_lossscale.integrations.compat import accelerate_has_4242

    class FusedLikeScaler:
        def step(self, optimizer, closure=None):
            optimizer.step()  # the kernel runs, and skips on the device's found-inf flag

        def update(self):
            pass

    Accelerator()  # the state AcceleratedOptimizer reads
    model = torch.nn.Linear(2, 1)
    optimizer = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=FusedLikeScaler())
    optimizer.step()
    observed_bug = optimizer.step_was_skipped is False  # the step was skipped in the kernel
    assert accelerate_has_4242() == observed_bug
