import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # the marker, not a parameter id "cuda"
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def reset_accelerate_state(monkeypatch):
    """Accelerate keeps process-wide singletons; give each test a clean slate."""
    for var in list(os.environ):
        if var.startswith(("HF_LOSSSCALE_", "ACCELERATE_")):
            monkeypatch.delenv(var)
    yield
    try:
        from accelerate.state import AcceleratorState, GradientState, PartialState
    except ImportError:
        return
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
