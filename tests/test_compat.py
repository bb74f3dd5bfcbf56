"""Guard: fails loudly when accelerate / transformers change under the integration."""

import importlib
import inspect
from importlib.metadata import version

import pytest

from hf_lossscale._compat import INTERNALS, TESTED_VERSIONS, major_minor


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


def test_accelerated_optimizer_step_protocol():
    from accelerate.optimizer import AcceleratedOptimizer

    src = inspect.getsource(AcceleratedOptimizer)
    # How Accelerate drives a scaler and decides "skipped": we replace that decision.
    for needle in (
        "self.scaler.step(self.optimizer, closure)",
        "self.scaler.update()",
        "_accelerate_step_called",
    ):
        assert needle in src, f"AcceleratedOptimizer no longer contains {needle!r}"


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
