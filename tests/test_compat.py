"""Guard: fails loudly when accelerate / transformers change under the integration."""

import importlib
from importlib.metadata import version

import pytest
import torch

from hf_lossscale._compat import INSTANCE_INTERNALS, INTERNALS, TESTED_VERSIONS, major_minor


@pytest.mark.parametrize("package", sorted(TESTED_VERSIONS))
def test_installed_versions_are_the_tested_ones(package):
    from importlib.metadata import PackageNotFoundError

    from hf_lossscale._compat import OPTIONAL

    try:
        version(package)
    except PackageNotFoundError:
        if package in OPTIONAL:
            pytest.skip(f"{package} (an optional extra) is not installed")
        raise
    installed = major_minor(version(package))
    assert installed == TESTED_VERSIONS[package], (
        f"{package} {version(package)} is installed but hf_lossscale is tested against "
        f"{TESTED_VERSIONS[package]}.x: re-run the integration tests, check the internals in "
        "hf_lossscale/_compat.py, then update TESTED_VERSIONS."
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

    from hf_lossscale import _compat, install_loss_scaler

    monkeypatch.setitem(_compat.TESTED_VERSIONS, "accelerate", "0.1")
    monkeypatch.setattr(_compat, "_warned", False)
    expected = re.escape(f"accelerate {version('accelerate')} (tested: 0.1.x)")
    with pytest.warns(UserWarning, match=expected):
        install_loss_scaler(Accelerator(mixed_precision="fp16"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        install_loss_scaler(Accelerator(mixed_precision="fp16"))  # named once per process
    assert _compat.untested_versions() == {"accelerate": version("accelerate")}
