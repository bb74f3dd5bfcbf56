import copy
import io
import random
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_rule import ReferenceScaler, _f32
from sync_count import count_reads

from hf_lossscale import DynamicLossScaler, LossScaleCollapseError, LossScaleConfig


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def train(scaler, steps, bad_steps, *, optimizer="sgd", clip=None):
    """Train with `scaler`, putting an inf into one gradient at each step of `bad_steps`."""
    model = tiny_model()
    opt = make_optimizer(optimizer, model)
    scales, params = [], []
    for step in range(steps):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if step in bad_steps:
            model[0].weight.grad[0, 0] = float("inf")
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        params.append([p.detach().clone() for p in model.parameters()])
    return scales, params, model, opt


def make_optimizer(kind, model):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    if kind == "adamw_fused":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    if kind == "adamw_single":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    raise ValueError(kind)


# ---------------------------------------------------------------- the rule vs the reference
configs = st.builds(
    LossScaleConfig,
    mode=st.sampled_from(["dynamic", "dynamic", "static", "off"]),
    init_scale=st.sampled_from([1.0, 2.0**4, 2.0**10, 2.0**16]),
    growth_factor=st.sampled_from([2.0, 4.0, 1.5]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.75]),
    growth_interval=st.integers(1, 6),
    min_scale=st.sampled_from([1.0]),
    max_scale=st.sampled_from([2.0**16, 2.0**20]),
    hysteresis=st.integers(1, 4),
    consecutive_hysteresis=st.booleans(),
    max_consecutive_skips=st.just(None),
)


def drive_rule(scaler, overflows):
    """Run `update()` for a sequence of overflow flags, without a model."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.0)
    for overflow in overflows:
        scaler.scale(p.sum()).backward()
        if overflow:
            p.grad[1] = float("nan")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        yield scaler


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, overflows=st.lists(st.booleans(), min_size=1, max_size=40))
def test_update_rule_matches_reference(config, overflows):
    ref = ReferenceScaler(config)
    scaler = DynamicLossScaler(config)
    for overflow, s in zip(overflows, drive_rule(scaler, overflows)):
        ref.update(overflow)
        st_ = s.stats()
        assert st_["loss_scale"] == _f32(ref.scale)
        assert st_["total_steps"] == ref.total_steps
        assert st_["skipped_steps"] == ref.skipped_steps
        assert st_["consecutive_skips"] == ref.consecutive_skips
        if config.mode == "dynamic":
            assert st_["growth_tracker"] == ref.growth_tracker
            assert st_["hysteresis_tracker"] == ref.hysteresis_tracker
        assert s.last_step_skipped == (overflow and config.mode != "off")


def test_floor_ceiling_and_hysteresis_by_hand():
    c = LossScaleConfig(init_scale=8.0, min_scale=2.0, max_scale=16.0, growth_interval=1, hysteresis=2)
    s = DynamicLossScaler(c)
    seen = [x.get_scale() for x in drive_rule(s, [0, 0, 0, 1, 1, 1, 1, 1, 0])]
    # grow to the ceiling, keep it; first overflow uses the hysteresis budget, then back off to the floor
    assert seen == [16.0, 16.0, 16.0, 16.0, 8.0, 4.0, 2.0, 2.0, 4.0]


# ---------------------------------------------------------------- equivalence with torch
@settings(max_examples=25, deadline=None)
@given(
    bad=st.sets(st.integers(0, 29), max_size=10),
    factors=st.sampled_from([(2.0, 0.5), (1.7, 0.3), (3.0, 0.9)]),
    interval=st.integers(1, 5),
    optimizer=st.sampled_from(["sgd", "adamw", "adamw_fused"]),
)
def test_identical_to_torch_grad_scaler(bad, factors, interval, optimizer):
    gf, bf = factors
    kw = dict(init_scale=2.0**8, growth_factor=gf, backoff_factor=bf, growth_interval=interval)
    torch_scales, torch_params, *_ = train(torch.amp.GradScaler("cpu", **kw), 30, bad, optimizer=optimizer)
    ours = DynamicLossScaler(min_scale=2.0**-30, max_scale=2.0**60, **kw)
    our_scales, our_params, *_ = train(ours, 30, bad, optimizer=optimizer)
    assert our_scales == torch_scales
    for a, b in zip(torch_params, our_params):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


# ---------------------------------------------------------------- skipped steps touch nothing
@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "adamw_fused", "adamw_single"])
def test_skipped_step_leaves_params_and_optimizer_state(optimizer):
    model = tiny_model()
    opt = make_optimizer(optimizer, model)
    scaler = DynamicLossScaler(init_scale=2.0**10)
    for step in range(3):
        x, y = batch(step)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if step == 2:
            before = copy.deepcopy((model.state_dict(), opt.state_dict()))
            model[2].bias.grad[0] = float("-inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    after = (model.state_dict(), opt.state_dict())
    for k, v in before[0].items():
        assert torch.equal(v, after[0][k])
    for pid, state in before[1]["state"].items():
        for k, v in state.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(after[1]["state"][pid][k])), (pid, k)
    assert scaler.last_step_skipped and scaler.get_scale() == 2.0**9
    assert scaler.stats()["skipped_steps"] == 1


def test_off_mode_applies_every_step_and_static_keeps_scale():
    off = DynamicLossScaler(mode="off")
    scales, params, *_ = train(off, 3, {1})
    assert scales == [1.0, 1.0, 1.0]
    assert not torch.isfinite(params[1][0]).all()  # the inf went in: that is what "off" means
    assert off.stats()["skipped_steps"] == 0 and off.stats()["total_steps"] == 3
    static = DynamicLossScaler(mode="static", init_scale=2.0**20)
    scales, params, *_ = train(static, 6, {1, 4})
    assert scales == [2.0**20] * 6
    assert static.stats()["skipped_steps"] == 2
    assert all(torch.isfinite(p).all() for ps in params for p in ps)


def test_several_optimizers_skip_independently_and_update_once():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.AdamW(b.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**8, growth_interval=1)
    a_before, b_before = copy.deepcopy(a.state_dict()), copy.deepcopy(b.state_dict())
    scaler.scale(b(a(torch.randn(3, 4))).sum()).backward()
    b.weight.grad[0, 0] = float("nan")
    scaler.step(opt_a)
    scaler.step(opt_b)
    scaler.update()
    assert not torch.equal(a.weight, a_before["weight"])  # clean optimizer stepped
    assert torch.equal(b.weight, b_before["weight"])  # overflowing one skipped
    assert scaler.get_scale() == 2.0**7  # one backoff for the iteration
    st_ = scaler.stats()
    assert (st_["total_steps"], st_["skipped_steps"]) == (1, 1)


def test_state_machine_errors():
    model = tiny_model()
    opt = make_optimizer("sgd", model)
    scaler = DynamicLossScaler()
    with pytest.raises(RuntimeError, match="before scale"):
        scaler.unscale_(opt)
    scaler.scale(model(batch(0)[0]).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called since the last update"):
        scaler.step(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match="no inf checks"):
        scaler.update()
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(opt, closure=lambda: 0)
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['init_scal'\]"):
        DynamicLossScaler(init_scal=2.0)


def test_scale_nested_outputs():
    s = DynamicLossScaler(init_scale=4.0)
    out = s.scale([torch.ones(2), (torch.ones(1), [torch.full((1,), 2.0)])])
    assert out[0].tolist() == [4.0, 4.0] and out[1][0].item() == 4.0 and out[1][1][0].item() == 8.0


# ---------------------------------------------------------------- accumulation + clipping
def test_accumulation_unscale_then_clip_on_sync_step():
    """Accumulate 4 micro-batches, unscale once, clip: matches an unscaled FP32 run exactly."""
    results = []
    for scaler in (None, DynamicLossScaler(init_scale=2.0**12)):
        model = tiny_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(12):
            x, y = batch(step)
            loss = torch.nn.functional.mse_loss(model(x), y) / 4
            (scaler.scale(loss) if scaler else loss).backward()
            if (step + 1) % 4 == 0:
                if scaler:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                if scaler:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                opt.zero_grad()
        results.append([p.detach() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)  # power-of-two scale: exact


# ---------------------------------------------------------------- checkpoints
def test_state_round_trip_mid_trajectory_continues_exactly():
    cfg = LossScaleConfig(init_scale=2.0**6, growth_interval=2, hysteresis=2, min_scale=4.0)
    pattern = [random.Random(3).random() < 0.4 for _ in range(30)]
    full = [s.stats() for s in drive_rule(DynamicLossScaler(cfg), pattern)]
    first = DynamicLossScaler(cfg)
    for _ in drive_rule(first, pattern[:13]):
        pass
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = DynamicLossScaler(cfg)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    rest = [s.stats() for s in drive_rule(resumed, pattern[13:])]
    assert rest == full[13:]


def test_loads_torch_grad_scaler_state():
    gs = torch.amp.GradScaler("cpu", init_scale=2.0**9)
    train(gs, 3, {1})
    s = DynamicLossScaler(init_scale=2.0**9)
    s.load_state_dict(gs.state_dict())
    assert s.get_scale() == gs.get_scale() and s._get_growth_tracker() == gs._get_growth_tracker()
    # and the reverse: torch's scaler can load ours
    gs2 = torch.amp.GradScaler("cpu")
    gs2.load_state_dict(s.state_dict())
    assert gs2.get_scale() == gs.get_scale()


def test_malformed_state_dicts_are_named():
    s = DynamicLossScaler()
    with pytest.raises(ValueError, match="empty"):
        s.load_state_dict({})
    with pytest.raises(ValueError, match=r"missing key\(s\) \['_growth_tracker'\]"):
        s.load_state_dict({"scale": 2.0})
    good = DynamicLossScaler().state_dict()
    broken = dict(good)
    del broken["skipped_steps"], broken["config"]
    with pytest.raises(ValueError, match=r"missing key\(s\) \['skipped_steps', 'config'\]"):
        s.load_state_dict(broken)
    with pytest.raises(ValueError, match=r"scale=-1\.0"):
        s.load_state_dict({**good, "scale": -1.0})
    with pytest.raises(ValueError, match=r"total_steps='3'"):
        s.load_state_dict({**good, "total_steps": "3"})
    with pytest.raises(ValueError, match=r"growth_factor=0\.5"):
        s.load_state_dict({**good, "config": {**good["config"], "growth_factor": 0.5}})
    with pytest.raises(ValueError, match="must be a dict"):
        s.load_state_dict([1])


def test_load_warns_on_config_difference_and_clamps():
    s = DynamicLossScaler(init_scale=2.0**10, max_scale=2.0**12)
    saved = DynamicLossScaler(init_scale=2.0**14, max_scale=2.0**20).state_dict()
    with pytest.warns(UserWarning) as rec:
        s.load_state_dict(saved)
    text = " ".join(str(w.message) for w in rec)
    assert "init_scale" in text and "max_scale" in text and "using 4096" in text
    assert s.get_scale() == 2.0**12


def test_state_dict_is_plain_and_device_free():
    s = DynamicLossScaler()
    drive = list(drive_rule(s, [0, 1]))
    assert drive
    sd = s.state_dict()
    assert all(not isinstance(v, torch.Tensor) for v in sd.values())
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True) == sd


# ---------------------------------------------------------------- host syncs
def one_step_reads(scaler_factory, optimizer):
    """Scalar reads of one scaled step minus those of the bare optimizer step."""
    model = tiny_model()
    opt = make_optimizer(optimizer, model)
    x, y = batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()  # create the optimizer state first
    opt.step()
    bare = count_reads(opt.step)
    scaler = scaler_factory()
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()  # lazy init outside the counted region

    def scaled_step():
        scaler.scale(loss.detach())
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    return count_reads(scaled_step) - bare


@pytest.mark.parametrize("optimizer", ["adamw_fused", "sgd", "adamw", "adamw_single"])
def test_host_syncs_added_per_step(optimizer):
    ours = one_step_reads(lambda: DynamicLossScaler(hysteresis=2, min_scale=1.0), optimizer)
    theirs = one_step_reads(lambda: torch.amp.GradScaler("cpu"), optimizer)
    print(f"{optimizer}: DynamicLossScaler adds {ours}, torch GradScaler adds {theirs}")
    assert ours <= theirs
    assert ours == (0 if optimizer == "adamw_fused" else 1)


def test_no_sync_in_scale_unscale_update():
    model = tiny_model()
    opt = make_optimizer("adamw_fused", model)
    scaler = DynamicLossScaler()
    x, y = batch(0)
    assert count_reads(lambda: scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()) == 0
    assert count_reads(lambda: (scaler.unscale_(opt), scaler.step(opt), scaler.update())) == 0


# ---------------------------------------------------------------- errors users meet
def test_fp16_parameters_get_a_clear_error():
    model = tiny_model().half()
    scaler = DynamicLossScaler(master_weights=False)  # the default ("auto") trains it on FP32 masters
    scaler.set_parameter_names(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(batch(0)[0].half()).float().sum()).backward()
    with pytest.raises(ValueError, match=r"held in float16: 0\.weight, 0\.bias.*load the model in float32"):
        scaler.step(opt)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw_fused"])
def test_collapse_error_names_scale_floor_and_parameters(optimizer):
    model = tiny_model()
    scaler = DynamicLossScaler(init_scale=8.0, min_scale=2.0, max_consecutive_skips=5)
    scaler.set_parameter_names(model)
    opt = make_optimizer(optimizer, model)
    with pytest.raises(LossScaleCollapseError) as err:
        for step in range(10):
            x, y = batch(step)
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            model[2].weight.grad.fill_(float("nan"))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    # It fires once the host knows of 5 skips in a row: at the 5th update where the counter's copy
    # lands at once (the CPU), a few updates later where it lands later (CUDA): never before the
    # limit, and it reports the count it read, which is at most the updates run.
    msg = str(err.value)
    known = int(re.search(r"(\d+) optimizer steps in a row", msg).group(1))
    assert step >= 4 and 5 <= known <= step + 1
    assert "Scale now 2" in msg and "min_scale=2" in msg
    assert "2.weight" in msg and "0.weight" not in msg


def test_explicit_cuda_device_without_cuda_is_an_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        DynamicLossScaler(device="cuda")


@pytest.mark.cuda
def test_cuda_fused_path_has_no_sync():
    """Scale, unscale, fused step and update, with telemetry every step and one overflowing step,
    under `set_sync_debug_mode("error")` (run by benchmarks/gpu_check.sh)."""
    model = tiny_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = DynamicLossScaler(telemetry_interval=1)
    x, y = (t.cuda() for t in batch(0))
    for _ in range(2):  # warm up: lazy init, optimizer state, pinned buffer
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(3):
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if i == 1:
                # a skipped step, still no sync (an indexed assignment copies the value from the host: a sync)
                next(model.parameters()).grad.view(-1)[:1].fill_(float("inf"))
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    stats = scaler.stats()  # reading syncs, by design, once
    assert stats["total_steps"] == 5 and stats["skipped_steps"] == 1
    assert scaler.telemetry.read()["headroom_bits"] is not None


def test_sync_counter_tells_host_copies_from_device_reads():
    """The counter skips what `HostCopy.value()` reads (a copy already on the host) and counts the same
    read made outside it, and puts `HostCopy.value` back on exit. Bugs caught: a counter that ignores
    every read of a host-memory tensor (on the CPU all tensors are, so it would count nothing), one
    that counts host copies (the fused path would show syncs it does not make), a wrapper left behind."""
    from sync_count import CountHostReads

    from hf_lossscale.core.hostcopy import HostCopy

    original = HostCopy.value
    flag = torch.tensor([1.0, 0.0])
    with CountHostReads() as counter:
        copy = HostCopy(flag)
        assert copy.value() == [1.0, 0.0]
        assert counter.count == 0
        flag.tolist()
        assert counter.count == 1 and counter.reads == ["tolist"]
    assert HostCopy.value is original
