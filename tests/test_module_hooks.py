"""`ModuleHooks`: the one walker that hangs a hook on every submodule (overflow diagnosis, telemetry,
pre-flight)."""

import pytest
import torch

from hf_lossscale.core.module_hooks import ModuleHooks


def _model():
    shared = torch.nn.Linear(3, 3)
    return torch.nn.Sequential(shared, torch.nn.ReLU(), shared, torch.nn.Linear(3, 1))


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._backward_hooks) for m in model.modules())


def test_each_module_once_with_its_name_and_removed_on_leaving():
    """Bug caught: a walker that hooks a shared module twice (its hook fires twice per call), passes
    the wrong name, or leaves a hook behind."""
    model = _model()
    seen = []
    with ModuleHooks(model, forward=lambda name, module, args, output: seen.append(name)):
        model(torch.ones(2, 3))
    assert seen == ["0", "1", "0", "3", ""]  # the shared Linear, hooked once under its first name
    assert _hook_count(model) == 0
    model(torch.ones(2, 3))
    assert len(seen) == 5


def test_where_kwargs_and_backward():
    model = _model()
    forward, backward = [], []
    hooks = ModuleHooks(
        model,
        forward=lambda name, module, args, kwargs, output: forward.append((name, kwargs)),
        backward=lambda name, module, grad_input, grad_output: backward.append(name),
        with_kwargs=True,
        where=lambda name: name in ("0", "3"),
    )
    model(torch.ones(2, 3, requires_grad=True)).sum().backward()
    hooks.remove()
    hooks.remove()  # a second call does nothing
    assert forward == [("0", {}), ("0", {}), ("3", {})]
    assert backward == ["3", "0", "0"]
    assert _hook_count(model) == 0


def test_hooks_are_removed_when_the_block_raises():
    model = _model()
    with pytest.raises(RuntimeError, match="boom"), ModuleHooks(model, forward=lambda *a: None):
        raise RuntimeError("boom")
    assert _hook_count(model) == 0
