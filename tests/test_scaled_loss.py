"""`core.scaled_loss`: a scaled loss whose backward runs under the scaler's backward context (what
`install_loss_scaler` sets for emulated CPU FP16)."""

import contextlib
import pickle

import pytest
import torch
from tiny_models import tiny_mlp

from hf_lossscale import DynamicLossScaler, LossScaleConfig
from hf_lossscale.core.scaled_loss import ScaledLoss


def recording():
    entered = []

    @contextlib.contextmanager
    def context():
        entered.append("in")
        yield
        entered.append("out")

    return entered, context


@pytest.mark.parametrize("mode", ["dynamic", "off"])
@pytest.mark.parametrize("call", ["method", "autograd.backward", "autograd.grad"])
def test_the_backward_runs_under_the_context_and_nothing_else_does(mode, call):
    """Bugs caught: the context left out for one way of starting a backward (or in "off" mode, where
    scale() gives the loss back unscaled), and the subclass leaking into what is computed from the loss
    (its type on every result)."""
    model = tiny_mlp()
    scaler = DynamicLossScaler(LossScaleConfig(mode=mode, init_scale=8.0))
    entered, context = recording()
    scaler._backward_context = context
    loss = model(torch.randn(3, 4)).pow(2).mean()
    scaled = scaler.scale(loss)
    assert isinstance(scaled, ScaledLoss) and entered == []
    derived = [scaled * 2, scaled.detach(), scaled + loss, torch.exp(scaled)]
    assert all(type(t) is torch.Tensor for t in derived)
    assert scaled.item() == pytest.approx(loss.item() * (8.0 if mode == "dynamic" else 1.0))
    if call == "method":
        scaled.backward()
    elif call == "autograd.backward":
        torch.autograd.backward([scaled])
    else:
        grads = torch.autograd.grad(scaled, list(model.parameters()))
        assert all(type(g) is torch.Tensor for g in grads)
    assert entered == ["in", "out"]


def test_a_scaler_without_a_context_gives_the_plain_product():
    """torch's GradScaler contract: without a backward context, scale() gives a plain tensor."""
    scaler = DynamicLossScaler(LossScaleConfig(init_scale=8.0))
    assert type(scaler.scale(torch.ones((), requires_grad=True))) is torch.Tensor


def test_a_pickled_scaler_leaves_its_context_behind():
    """The context is the install's (a closure over its accelerator): a pickled scaler (a checkpoint,
    a worker) leaves it out and unpickles without one. Bug caught: pickling failing on a local function."""
    scaler = DynamicLossScaler(LossScaleConfig(init_scale=8.0))
    scaler._backward_context = recording()[1]
    again = pickle.loads(pickle.dumps(scaler))
    assert again._backward_context is None
    assert type(again.scale(torch.ones((), requires_grad=True))) is torch.Tensor


def test_a_hook_reading_a_masters_gradient_during_the_backward_reads_it_under_the_context():
    """A model held in FP16 on FP32 masters: after `unscale_` the FP16 parameters' `.grad` are stand-ins
    for the masters' gradients; a hook that reads one during the next backward (a logger, a gradient
    penalty) reads the master's values, with and without a backward context alike. Bug caught: the
    backward run with subclass dispatch off, where the stand-in reads as the broadcast view it is."""
    seen = []
    for with_context in (False, True):
        model = tiny_mlp().half()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = DynamicLossScaler(LossScaleConfig(init_scale=2.0**8, master_weights=True))
        scaler.master_weights.attach(opt)
        if with_context:
            scaler._backward_context = contextlib.nullcontext
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, 4, generator=g).half()
        scaler.scale(model(x).float().pow(2).mean()).backward()
        scaler.unscale_(opt)  # the gradients move into the masters; the FP16 `.grad` stand in for them
        out = model(x).float()
        weight = model[0].weight
        read = []
        out.register_hook(lambda grad, w=weight, into=read: into.append(w.grad.float().abs().sum().item()))
        scaler.scale(out.pow(2).mean()).backward()
        seen.append(read[0])
    assert seen[0] > 0 and seen[0] == seen[1]


def test_formats_as_the_loss_and_is_plain_under_torch_compile():
    """Bugs caught (a review found both): `f"{loss:.3f}"` raising on the subclass, and `scale()` inside a
    compiled function making the subclass, which aot_autograd cannot trace (the multiple-dispatch error)."""
    scaler = DynamicLossScaler(LossScaleConfig(init_scale=8.0))
    scaler._backward_context = recording()[1]
    loss = torch.tensor(1.25, requires_grad=True)
    assert f"{scaler.scale(loss):.2f}" == "10.00"

    @torch.compile(backend="aot_eager")
    def scaled(x):
        return scaler.scale(x * 2)

    out = scaled(loss)
    assert type(out) is torch.Tensor and out.item() == 20.0
