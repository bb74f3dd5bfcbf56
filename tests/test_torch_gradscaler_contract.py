"""The behaviours torch's own GradScaler tests check (pytorch `test/test_torch.py`,
`TestTorchDeviceType`, `test_pickle_gradscaler` .. `test_grad_scaler_pass_itself`), written for
`DynamicLossScaler`: the type, pickling, the state dict, torch's `_unscale_grads_` contract, an
optimizer that takes `grad_scaler=`, a scale at FP32's edge, and the private helpers other code calls.
torch's tests themselves were run against ours from a copy outside the repository (see the README)."""

import pickle
import warnings

import pytest
import torch

from hf_lossscale import DynamicLossScaler, LossScaleConfig


def test_is_a_torch_gradscaler_that_runs_none_of_torchs_code():
    """isinstance passes (code that type-checks "a GradScaler" accepts ours), and every method
    torch's class defines is our own. Bug caught: a torch release adds a method that a subclass
    would inherit silently, running on attributes ours does not keep."""
    scaler = DynamicLossScaler()
    assert isinstance(scaler, torch.amp.GradScaler)
    torch_methods = [n for n, v in vars(torch.amp.GradScaler).items() if callable(v)]
    assert (
        "_unscale_grads_" in torch_methods and "__getstate__" in torch_methods
    )  # the list is torch's, read live

    def owner(name):  # the class that defines what DynamicLossScaler.<name> resolves to
        return next(k for k in DynamicLossScaler.__mro__ if name in vars(k))

    inherited = [n for n in torch_methods if not owner(n).__module__.startswith("hf_lossscale.")]
    assert inherited == [], f"torch.amp.GradScaler methods DynamicLossScaler would inherit: {inherited}"


def _storm_grads(g, inject):
    grads = [g.clone(), g.clone()[:, :5], g.to(torch.float16), g.to(torch.float16)]  # strided, FP16 too
    if inject >= 0:
        grads[inject][2, 2] = float("inf")
    return grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unscale_grads_takes_torchs_arguments(dtype):
    """`_unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)` as torch's: grouped by dtype,
    non-contiguous gradients included, the flag accumulated into the caller's `found_inf`. Bug caught:
    our two-argument signature (a TypeError for every caller of torch's), or a flag written to a
    fresh tensor the caller never sees."""
    g = torch.full((20, 20), 4.0, dtype=dtype)
    inv_scale = torch.full((1,), 0.25)
    params = [torch.empty_like(x) for x in _storm_grads(g, -1)]  # FP16 parameters: allow_fp16=True
    opt = torch.optim.SGD(params, lr=1.0)
    scaler = DynamicLossScaler()
    for inject in range(-1, len(params)):
        found_inf = torch.zeros(1)
        grads = _storm_grads(g, inject)
        for p, grad in zip(params, grads):
            p.grad = grad
        per_device = scaler._unscale_grads_(opt, inv_scale, found_inf, True)
        assert per_device[found_inf.device] is found_inf
        assert found_inf.item() == (1.0 if inject >= 0 else 0.0)
        if inject < 0:
            for grad in grads:
                torch.testing.assert_close(grad, torch.ones_like(grad), rtol=0, atol=0)
    # our default (the path unscale_ takes) still refuses FP16 parameters, with the way out named
    with pytest.raises(ValueError, match="held in float16"):
        scaler._unscale_grads_(opt, inv_scale)


def test_unscale_grads_sparse_and_uncoalesced_fp16():
    """Sparse gradients are unscaled through their values; an FP16 one is coalesced first, so two
    entries of 64000 at one index are the overflow they add up to. Bug caught: checking the
    uncoalesced values, which are each finite."""
    scaler = DynamicLossScaler()
    inv_scale = torch.full((1,), 0.25)
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    s = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, 64.0]), (2, 3))
    p = s.clone()
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = s.clone()
    found = torch.zeros(1)
    assert scaler._unscale_grads_(opt, inv_scale, found, False)[found.device].item() == 0.0
    assert torch.equal(p.grad.to_dense(), (s / 4).to_dense())
    for bad in (float("inf"), float("nan")):
        p.grad = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, bad]), (2, 3))
        found.zero_()
        assert scaler._unscale_grads_(opt, inv_scale, found, False)[found.device].item() == 1.0
    p = s.clone().half()
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.sparse_coo_tensor(
        torch.tensor([[0, 1, 0], [2, 0, 2]]),
        torch.tensor([64000.0, 32.0, 64000.0]),
        (2, 3),
        dtype=torch.float16,
    )
    found.zero_()
    assert scaler._unscale_grads_(opt, inv_scale, found, True)[found.device].item() == 1.0


def test_pickles_between_iterations_like_torch():
    """A pickled scaler keeps its scale, factors, interval and growth tracker, and its per-optimizer
    record equals torch's fresh one (torch's OptState). Mid-iteration it refuses, as torch's does.
    Bug caught: our own OptState enum, which torch's stages never equal."""
    for materialise in (True, False):
        a = DynamicLossScaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        if materialise:
            a.scale(torch.tensor([4.0]))
        b = pickle.loads(pickle.dumps(a))
        assert (b.get_scale(), b.get_growth_factor(), b.get_backoff_factor(), b.get_growth_interval()) == (
            3.0, 4.0, 0.5, 2,
        )  # fmt: skip
        assert b._init_growth_tracker == 0
        assert b._per_optimizer_states["x"] == torch.amp.grad_scaler._refresh_per_optimizer_state()
        assert b.scale(torch.tensor([4.0])).item() == 12.0
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # after updates too (torch's autocast test pickles after every update)
        a.scale(model(torch.ones(1, 2)).sum()).backward()
        a.step(opt)
        a.update()
    b = pickle.loads(pickle.dumps(a))
    assert b.get_scale() == a.get_scale() and b.stats() == a.stats()
    assert bool(b.last_backed_off) is False and b.scale(torch.tensor([1.0])).item() == a.get_scale()
    a.scale(model(torch.ones(1, 2)).sum()).backward()
    a.unscale_(opt)
    with pytest.raises(RuntimeError, match="between iterations"):
        pickle.dumps(a)


@pytest.mark.parametrize("source", ["torch", "ours"])
def test_load_state_dict_restores_the_factors_and_interval(source):
    """Loading takes the growth/backoff factors, the interval and the growth tracker from the
    state, as torch's does, and says which it changed. Bug caught: the current config kept (ours
    until this test), which a run resumed through torch's API silently diverged on."""
    Saved = torch.amp.GradScaler if source == "torch" else DynamicLossScaler
    kwargs = {"device": "cpu"} if source == "torch" else {}
    s0 = Saved(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2, **kwargs)
    s1 = DynamicLossScaler(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    s1.scale(torch.ones(1))
    s1._init_growth_tracker = 7
    with pytest.warns(UserWarning, match="as torch.amp.GradScaler does") as record:
        s1.load_state_dict(s0.state_dict())
    assert "growth_interval" in str(record[0].message)
    assert (s1.get_scale(), s1.get_growth_factor(), s1.get_backoff_factor(), s1.get_growth_interval()) == (
        3.0, 4.0, 0.5, 2,
    )  # fmt: skip
    assert s1._init_growth_tracker == 0 and s1.config.growth_interval == 2
    with warnings.catch_warnings(
        record=True
    ) as again:  # the same state again: nothing restored, nothing said
        warnings.simplefilter("always")
        s1.load_state_dict(s0.state_dict())
    assert not [w for w in again if "as torch.amp.GradScaler does" in str(w.message)]
    bad = {**s0.state_dict(), "growth_interval": 0}
    with pytest.raises(ValueError, match="Loss-scaler state: .*growth_interval"):
        s1.load_state_dict(bad)


def test_an_optimizer_taking_grad_scaler_gets_the_scaler():
    """torch's older contract: an optimizer with `_step_supports_amp_scaling` whose `step` takes
    `grad_scaler` gets the scaler itself (with torch's FutureWarning) and no grad_scale/found_inf
    attributes; one without it gets the two tensors. Bug caught: the keyword never passed, so such an
    optimizer stepped unscaled gradients."""
    seen = {}

    class Base(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})
            self._step_supports_amp_scaling = True

    class TakesScaler(Base):
        def step(self, closure=None, *, grad_scaler=None):
            seen["scaler"] = grad_scaler
            seen["attrs"] = hasattr(self, "grad_scale") or hasattr(self, "found_inf")

    class TakesTensors(Base):
        def step(self, closure=None):
            seen["tensors"] = (self.grad_scale, self.found_inf)

    m = torch.nn.Linear(4, 1)
    o1, o2 = TakesScaler(m.parameters()), TakesTensors(m.parameters())
    scaler = DynamicLossScaler(init_scale=2.0)
    scaler.scale(m(torch.randn(4, 4)).mean()).backward()
    with pytest.warns(FutureWarning, match="grad_scaler"):
        scaler.step(o1)
    scaler.step(o2)
    scaler.update()
    assert seen["scaler"] is scaler and seen["attrs"] is False
    grad_scale, found_inf = seen["tensors"]
    assert grad_scale.item() == 2.0 and found_inf.item() == 0.0


def test_a_scale_at_fp32s_edge_never_becomes_inf():
    """`init_scale=1e38` as torch takes it: the torch-style constructor raises the ceiling to the
    initial scale, and growth stops there instead of reaching inf. An explicit ceiling or a
    `LossScaleConfig` still refuses it. Bug caught: 1e38 refused (torch's test) or, with the
    ceiling lifted to FP32 max, 1e38 x 16 = inf and every later step skipped."""
    model = torch.nn.Linear(5, 1)
    with torch.no_grad():  # clean steps whatever the RNG: a random loss above ~3.4 overflows at 1e38
        model.weight.zero_()
        model.bias.zero_()
    opt = torch.optim.Adam(model.parameters())
    scaler = DynamicLossScaler(growth_interval=1, growth_factor=2**4, init_scale=1e38)
    for _ in range(3):
        loss = ((model(torch.randn(1, 5)) - 1e-30) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert scaler.get_scale() == pytest.approx(1e38, rel=1e-6)
    with pytest.raises(ValueError, match="init_scale"):
        DynamicLossScaler(init_scale=1e38, max_scale=2.0**24)
    with pytest.raises(ValueError, match="init_scale"):
        LossScaleConfig(init_scale=1e38)


def test_torchs_private_helpers_work_on_ours():
    """The private helpers code written against torch's scaler calls (FSDP's sharded scaler,
    Lightning's plugins): `_lazy_init_scale_growth_tracker`, `_check_scale_growth_tracker`,
    `_found_inf_per_device`, `_maybe_opt_step`, `_growth_tracker`, `_enabled`. Bug caught: an
    AttributeError from a name torch's __init__ would have set."""
    scaler = DynamicLossScaler(init_scale=8.0)
    assert scaler._enabled is True and scaler._growth_tracker is None
    scaler._lazy_init_scale_growth_tracker("cpu")
    scale, tracker = scaler._check_scale_growth_tracker("step")
    assert scale.item() == 8.0 and tracker.item() == 0 and scaler._growth_tracker is tracker
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    model.weight.grad[0, 0] = float("inf")
    scaler.unscale_(opt)
    assert sum(f.item() for f in scaler._found_inf_per_device(opt).values()) == 1.0
    before = model.weight.detach().clone()
    assert scaler._maybe_opt_step(opt, scaler._per_optimizer_states[id(opt)]) is None  # skipped
    assert torch.equal(model.weight, before)
    assert DynamicLossScaler(enabled=False)._enabled is False


def test_a_scaler_pickled_before_its_flags_and_outcome_were_objects_loads():
    """A pickle from before `StepFlags` and `StepOutcome` (its flags buffer, loss probe and last-step
    flags as attributes of the scaler) unpickles into them and trains on. Bug caught: an
    AttributeError on `flags` or `last_step` at the first step after loading such a pickle."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a = DynamicLossScaler(init_scale=4.0)
    a.scale(model(torch.ones(1, 2)).sum()).backward()
    a.step(opt)
    a.update()
    old = a.__getstate__()
    del old["flags"], old["last_step"]
    old.update(_loss_probe=None, _flags={}, _found_taken=False, _host_skipped=False,
               _backed_off=torch.tensor(False), last_loss_nonfinite=torch.tensor(False))  # fmt: skip
    b = DynamicLossScaler.__new__(DynamicLossScaler)
    b.__setstate__(old)
    assert b.last_step_skipped_if_known is False and bool(b.last_backed_off) is False
    assert b.last_step.skipped is False and b.stats() == a.stats()
    b.scale(model(torch.ones(1, 2)).sum()).backward()
    b.step(opt)
    b.update()
    assert b.stats()["total_steps"] == 2
