"""The chunked update (`masters/step.py`) and the ways of holding FP16 weights below the FP32
masters' memory: `master_weights="kahan"` and `"stochastic_rounding"` (issue 49)."""

from __future__ import annotations

import io
import warnings
import weakref

import pytest
import torch

from hf_lossscale import DynamicLossScaler, LossScaleConfig
from hf_lossscale.masters import step as chunked
from hf_lossscale.masters.step import ALIGN, Slot, round_stochastic, run_chunked

SHAPES = [(300, 7), (1000,), (5,), (77, 13), (1,)]


def _optimizers():
    out = []
    for foreach, fused in ((False, None), (True, None), (None, True)):
        for amsgrad in (False, True):
            out.append(
                (torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.1, "amsgrad": amsgrad}, foreach, fused)
            )
            out.append(
                (torch.optim.Adam, {"lr": 0.1, "weight_decay": 0.1, "amsgrad": amsgrad}, foreach, fused)
            )
        for momentum, nesterov, dampening in ((0.0, False, 0.0), (0.9, True, 0.0), (0.9, False, 0.1)):
            kw = {
                "lr": 0.1,
                "momentum": momentum,
                "nesterov": nesterov,
                "dampening": dampening,
                "weight_decay": 0.01,
            }
            out.append((torch.optim.SGD, kw, foreach, fused))
    return out


@pytest.mark.parametrize("bucket", [1, 100, 333, 1 << 21])
@pytest.mark.parametrize(("cls", "kw", "foreach", "fused"), _optimizers())
def test_the_chunked_update_is_torchs_bitwise(cls, kw, foreach, fused, bucket):
    """Catches: a tensor cut mid-vector (the CPU kernels' scalar tail rounds differently), a step counter
    moved once per chunk instead of once per parameter, SGD's first momentum buffer lost between chunks,
    the fused kernel's `grad_scale` not passed, and (fused: the second of four steps skipped on its
    `found_inf`) a counter left moved on a skipped step, a skipped step that updates."""
    torch.manual_seed(0)
    values = [torch.randn(s) for s in SHAPES]
    ref = [torch.nn.Parameter(v.clone()) for v in values]
    sub = [torch.nn.Parameter(v.clone()) for v in values]
    o_ref = cls(ref, foreach=foreach, fused=fused, **kw)
    o_sub = cls(sub, foreach=foreach, fused=fused, **kw)
    scale = torch.tensor(8.0) if fused else None
    for t in range(4 if fused else 3):
        grads = [torch.randn(s) * (8.0 if fused else 1.0) for s in SHAPES]
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.clone()
        found = torch.tensor(1.0 if t == 1 else 0.0)
        if fused:
            o_ref.grad_scale, o_ref.found_inf = scale, found
        o_ref.step()
        slots = [
            Slot(
                key=p,
                numel=p.numel(),
                flat=True,
                grad_of=lambda a, b, g=g: g.view(-1)[a:b],
                load=lambda a, b, p=p: p.data.view(-1)[a:b],
                store=lambda a, b, v: None,
            )
            for p, g in zip(sub, grads, strict=True)
        ]
        run_chunked(o_sub, o_sub.param_groups[0], slots, scale, found if fused else None, bucket)
    for a, b in zip(ref, sub, strict=True):
        assert torch.equal(a, b)
    s_ref, s_sub = o_ref.state_dict()["state"], o_sub.state_dict()["state"]
    assert s_ref.keys() == s_sub.keys()
    for i in s_ref:
        assert s_ref[i].keys() == s_sub[i].keys()
        for key in s_ref[i]:
            assert torch.equal(s_ref[i][key], s_sub[i][key]), key
    assert ALIGN % 16 == 0  # the widest CPU vector of floats (AVX-512) divides the cut


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def _train(model, opt, scaler, steps, x, y, poison_at=None):
    for t in range(steps):
        loss = ((model(x.to(next(model.parameters()).dtype)).float() - y) ** 2).mean()
        if t == poison_at:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return loss


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    return x, x[:, :1] * 0.5


@pytest.mark.parametrize("mode", ["kahan", "stochastic_rounding"])
@pytest.mark.parametrize("fused", [False, True])
def test_a_mode_trains_near_the_fp32_masters_and_costs_its_bytes(mode, fused):
    """Catches: the compensation never read back (kahan drifts like plain FP16), the stochastic rounding
    biased, the bytes miscounted."""
    x, y = _data()
    runs = {}
    for m in ("masters", mode):
        model = _model().half()
        scaler = DynamicLossScaler(config=LossScaleConfig(master_weights=True if m == "masters" else m))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused or None)
        start = _train(model, opt, scaler, 1, x, y).item()
        end = _train(model, opt, scaler, 60, x, y).item()
        runs[m] = (start, end, scaler.master_weights.bytes(), model)
    n = sum(p.numel() for p in runs["masters"][3].parameters())
    assert runs["masters"][2] == 4 * n
    assert runs[mode][2] == (2 * n if mode == "kahan" else 0)
    start, end = runs[mode][0], runs[mode][1]
    assert end < 0.5 * start  # it trains
    assert abs(end - runs["masters"][1]) < 0.1 * runs["masters"][1]


def test_kahan_keeps_updates_below_half_an_ulp():
    """An update of a quarter ulp each step: lost entirely by FP16 round-to-nearest, kept by the
    compensation buffer (catches a buffer that is written but not added back in)."""
    for mode, expect_move in (("kahan", True),):
        w = torch.nn.Parameter(torch.ones(256, dtype=torch.float16))
        opt = torch.optim.SGD([w], lr=1.0)
        scaler = DynamicLossScaler(config=LossScaleConfig(master_weights=mode, init_scale=1.0, mode="static"))
        quarter = 2.0**-10 / 4  # FP16's ulp at 1.0 is 2^-10
        for _ in range(8):
            scaler.scale(w.float().sum() * quarter).backward()  # d/dw = quarter (scale 1)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        # 8 quarter-ulp steps down: 2 ulps below 1 (the spacing below 1.0 is 2^-11: 4 steps of it)
        assert expect_move
        assert torch.all(w.float() < 1.0)
        assert torch.allclose(w.float(), torch.full((256,), 1.0 - 8 * quarter), atol=2.0**-12)


def test_stochastic_rounding_is_unbiased_and_seeded():
    """Catches: the probability of the far neighbour inverted (biased toward it), a draw from the
    global generator (not reproducible by the generator passed)."""
    x = torch.full((200_000,), 1.0 + 2.0**-10 * 0.3)  # 0.3 of the way from 1.0 to the next FP16
    g = torch.Generator().manual_seed(0)
    r = round_stochastic(x, g)
    assert set(r.float().unique().tolist()) == {1.0, 1.0 + 2.0**-10}
    share = (r.float() > 1.0).double().mean().item()
    assert abs(share - 0.3) < 0.005  # 5 sigma at n = 2e5 is 0.005
    tiny = torch.full((200_000,), -(2.0**-24) * 3.37)  # FP16's subnormal range (spacing 2^-24)
    share = (round_stochastic(tiny, g).float() == -(2.0**-24) * 4).double().mean().item()
    assert abs(share - 0.37) < 0.006  # the others round to -3 x 2^-24
    again = round_stochastic(x, torch.Generator().manual_seed(0))
    assert torch.equal(r, again)
    assert not torch.equal(r, round_stochastic(x, torch.Generator().manual_seed(1)))
    exact = torch.tensor([1.0, -2.5, 0.0, 65504.0, 1e6, float("nan")])
    out = round_stochastic(exact, g).float()
    assert torch.equal(out[:4], exact[:4]) and out[4] == float("inf") and out[5].isnan()


def _checkpoint(model, opt, scaler) -> bytes:
    buf = io.BytesIO()
    torch.save({"m": model.state_dict(), "o": opt.state_dict(), "s": scaler.state_dict()}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("mode", ["kahan", "stochastic_rounding"])
def test_a_resume_is_bitwise(mode):
    """The compensation / the generator's state travel in the optimizer's state: 10 steps, save, 10 more,
    against a fresh process's worth of objects loading the save (catches state left out of the
    checkpoint, a generator reseeded at load)."""
    x, y = _data()
    model = _model().half()
    scaler = DynamicLossScaler(config=LossScaleConfig(master_weights=mode))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, scaler, 10, x, y)
    blob = _checkpoint(model, opt, scaler)
    _train(model, opt, scaler, 10, x, y)

    torch.manual_seed(123)  # another process's seed: what continues must come from the checkpoint
    model2 = _model(seed=7).half()
    scaler2 = DynamicLossScaler(config=LossScaleConfig(master_weights=mode))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    ck = torch.load(io.BytesIO(blob))
    model2.load_state_dict(ck["m"])
    scaler2.master_weights.attach(opt2)
    opt2.load_state_dict(ck["o"])
    scaler2.load_state_dict(ck["s"])
    _train(model2, opt2, scaler2, 10, x, y)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["kahan", "stochastic_rounding"])
@pytest.mark.parametrize("fused", [False, True])
def test_a_skipped_step_leaves_the_weights_and_the_buffer_as_they_were(mode, fused):
    """A step whose gradients overflow (skipped on the host, or inside the fused kernel on the device)
    changes nothing: catches a store that rounds again (a tie flips) or draws a new rounding."""
    x, y = _data()
    model = _model().half()
    scaler = DynamicLossScaler(config=LossScaleConfig(master_weights=mode))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused or None)
    _train(model, opt, scaler, 5, x, y)
    before = [p.detach().clone() for p in model.parameters()]
    comps = [
        p.compensation.clone() for p in opt._hf_lossscale_masters.pairs.values() if p.compensation is not None
    ]
    _train(model, opt, scaler, 1, x, y, poison_at=0)
    assert scaler.stats()["skipped_steps"] == 1
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)
    now = [p.compensation for p in opt._hf_lossscale_masters.pairs.values() if p.compensation is not None]
    assert all(torch.equal(a, b) for a, b in zip(comps, now, strict=True))


def test_a_mode_refuses_an_optimizer_it_cannot_update():
    model = _model().half()
    scaler = DynamicLossScaler(config=LossScaleConfig(master_weights="kahan"))
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="RMSprop.*master_weights=True"):
        scaler.master_weights.attach(opt)
    # FP32 masters still take any optimizer (torch's own algorithm steps them)
    model = _model().half()
    scaler = DynamicLossScaler(config=LossScaleConfig(master_weights=True))
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    x, y = _data()
    _train(model, opt, scaler, 3, x, y)
    assert all(p.grad is None for p in model.parameters())


def test_a_state_of_another_mode_is_dropped_with_a_warning():
    """Masters saved, loaded by a Kahan optimizer: the weights stand, the compensation starts at zero,
    and the user is told (catches an FP32 master read as a compensation)."""
    x, y = _data()
    model = _model().half()
    scaler = DynamicLossScaler(config=LossScaleConfig(master_weights=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, scaler, 3, x, y)
    state = opt.state_dict()
    scaler2 = DynamicLossScaler(config=LossScaleConfig(master_weights="kahan"))
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler2.master_weights.attach(opt2)
    opt2.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, opt2, scaler2, 1, x, y)
    comps = [p.compensation for p in opt2._hf_lossscale_masters.pairs.values()]
    assert comps and all(c is not None for c in comps)


def test_the_environment_takes_the_modes():
    from hf_lossscale.core.config import config_from_env

    env = {"HF_LOSSSCALE_MASTER_WEIGHTS": "stochastic_rounding"}
    assert LossScaleConfig(**config_from_env(env)).master_weights == "stochastic_rounding"
    with pytest.raises(ValueError, match="master_weights='kahn'"):
        LossScaleConfig(master_weights="kahn")


class _LiveFP32:
    """The FP32 tensors made inside the mode that are alive at once (bytes; peak): a view or an in-place
    result allocates nothing and is not counted."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self
        self.live = self.peak = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                leaves = torch.utils._pytree.tree_leaves((args, kwargs))
                inputs = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
                for t in torch.utils._pytree.tree_leaves(
                    out
                ):  # new storage only (no view, no in-place result)
                    if (
                        isinstance(t, torch.Tensor)
                        and t.dtype == torch.float32
                        and t.untyped_storage().data_ptr() not in inputs
                    ):
                        size = t.untyped_storage().nbytes()
                        outer.live += size
                        outer.peak = max(outer.peak, outer.live)
                        weakref.finalize(t, outer._freed, size)
                return out

        self.mode = Mode()

    def _freed(self, size: int) -> None:
        self.live -= size


@pytest.mark.parametrize("mode", ["masters", "kahan", "stochastic_rounding"])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("rule", ["a 64th", "the package's"])
def test_no_step_holds_an_fp32_gradient_for_every_parameter(mode, clip, fused, rule, monkeypatch):
    """The memory floor: the scaler's own read and the step cast the FP16 gradients a bucket at a time;
    the FP32 tensors alive at once during clip + step stay a small share of 4 bytes per parameter (the
    old hand-over cast all of them: 100%) with buckets of a 64th, and within two of the package's
    largest buckets under its own rule (catches a bound that lets the bucket grow with the model).
    The weights still equal FP32 masters' to the bit (the differential test holds that; here: the
    step moved them)."""
    if rule == "a 64th":
        monkeypatch.setattr(chunked, "UPDATE_BUCKET", (1 << 12, 1 << 24))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(16))).half()
    n = sum(p.numel() for p in model.parameters())
    scaler = DynamicLossScaler(config=LossScaleConfig(master_weights=True if mode == "masters" else mode))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused or None)
    x = torch.randn(4, 512).half()
    for _ in range(2):  # the second step: the moments exist, the first made them
        scaler.scale(model(x).float().pow(2).mean()).backward()
        before = [p.detach().clone() for p in model.parameters()]
        live = _LiveFP32()
        with live.mode:
            if clip:
                scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    if rule == "a 64th":
        assert live.peak < 0.15 * 4 * n, f"{live.peak / (4 * n):.0%} of the FP32 gradients alive at once"
    else:
        bucket = 4 * chunked.UPDATE_BUCKET[1]
        assert live.peak <= 2 * bucket, f"{live.peak / bucket:.1f} buckets of FP32 alive at once"


@pytest.mark.parametrize("mode", ["masters", "kahan"])
def test_step_hooks_see_the_gradients_before_and_the_weights_after(mode):
    """A pre-hook registered after the masters exist sees every gradient, a post-hook registered before
    them sees the updated weights, as with FP32 weights (catches the chunked update's own hooks running
    in registration order: gradients hidden from later pre-hooks, weights old for earlier post-hooks)."""
    x, y = _data()
    model = _model().half()
    scaler = DynamicLossScaler(config=LossScaleConfig(master_weights=True if mode == "masters" else mode))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = {}

    def post(o, args, kwargs):
        seen["weights"] = [p.detach().clone() for p in model.parameters()]

    opt.register_step_post_hook(post)  # before the masters exist
    _train(model, opt, scaler, 1, x, y)
    opt.register_step_pre_hook(
        lambda o, a, k: seen.__setitem__(
            "grads", [p.grad is not None for g in o.param_groups for p in g["params"]]
        )
    )
    _train(model, opt, scaler, 1, x, y)
    assert seen["grads"] and all(seen["grads"])
    assert all(torch.equal(a, p) for a, p in zip(seen["weights"], model.parameters(), strict=True))


def test_a_kahan_resume_loading_the_optimizer_before_the_model_is_bitwise():
    """The compensation is taken at the step's check, against the weights then (catches one accepted at
    the optimizer's load, against the fresh weights, then zeroed as 'written from outside')."""
    x, y = _data()
    model = _model().half()
    scaler = DynamicLossScaler(config=LossScaleConfig(master_weights="kahan"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, scaler, 6, x, y)
    blob = _checkpoint(model, opt, scaler)
    _train(model, opt, scaler, 4, x, y)
    model2 = _model(seed=3).half()
    scaler2 = DynamicLossScaler(config=LossScaleConfig(master_weights="kahan"))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    ck = torch.load(io.BytesIO(blob))
    scaler2.master_weights.attach(opt2)
    opt2.load_state_dict(ck["o"])  # the optimizer first ...
    model2.load_state_dict(ck["m"])  # ... then the model
    scaler2.load_state_dict(ck["s"])
    _train(model2, opt2, scaler2, 4, x, y)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))


@pytest.mark.parametrize("mode", ["kahan", "stochastic_rounding"])
def test_a_sparse_gradient_is_refused_below_the_masters(mode):
    emb = torch.nn.Embedding(10, 4, sparse=True).half()
    scaler = DynamicLossScaler(config=LossScaleConfig(master_weights=mode, init_scale=1024.0))
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    scaler.scale(emb(torch.tensor([1, 2])).float().sum()).backward()
    with pytest.raises(ValueError, match="sparse gradient.*master_weights=True"):
        scaler.step(opt)
