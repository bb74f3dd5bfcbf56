"""FP32 master weights you can trust (issue 45): each ordinary path that trained differently, or
stopped, with a model held in FP16 behaves as the same model with FP32 weights, or raises at once
naming the remedy. One test per row of the issue's table; each failed on the design before (masters
swapped into the optimizer behind its back, keyed by `id()`, the FP16 gradient freed at `unscale_`,
a stale loss probe guessed from one sentinel parameter)."""

from __future__ import annotations

import gc
import io
import warnings
import weakref

import pytest
import torch
from master_twin import _NaNGrad

from hf_lossscale import DynamicLossScaler


def _model(dtype=torch.float16, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(dtype)


def _loss(model, i, bad=None):
    g = torch.Generator().manual_seed(i)
    dtype = next(model.parameters()).dtype
    x = torch.randn(6, 4, generator=g).to(dtype)
    loss = model(x).float().pow(2).mean()
    if bad is not None:
        loss = loss + float(bad)
    return loss


def _weights(model):
    return [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize("first", [0, 1])
@pytest.mark.parametrize("bad", ["inf", "nan"])
def test_accumulation_with_one_nonfinite_loss_skips_the_step_and_counts_it(bad, first):
    """Row 1: two accumulated micro-batches, the second's loss inf/NaN. FP32: the step is skipped,
    `nonfinite_loss_steps` 1, the LR held, the scale not backed off. Before: with masters the probe was
    dropped as "stale" (the sentinel was a master whose gradient is None between steps): the step was
    applied, counted 0, the LR advanced."""
    results = {}
    for dtype in (torch.float32, torch.float16):
        model = _model(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        scaler = DynamicLossScaler(init_scale=2.0**8)
        scaler.master_weights.attach(opt)  # as the Trainer and Accelerate do (a no-op in FP32)
        for i in range(2):  # a clean iteration first
            for m in range(2):
                scaler.scale(_loss(model, 10 * i + m, bad if (i, m) == (1, first) else None)).backward()
            before = _weights(model)
            scaler.unscale_(opt)  # torch's recipe (then a clip)
            scaler.step(opt)
            scaler.update()
            if scaler.last_step_skipped:
                sched_step_skipped = True
            else:
                sched.step()
                sched_step_skipped = False
            opt.zero_grad()
        moved = any(not torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
        stats = scaler.stats()
        results[dtype] = (moved, stats["nonfinite_loss_steps"], stats["loss_scale"], sched_step_skipped)
    assert results[torch.float32] == (False, 1, 2.0**8, True)
    assert results[torch.float16] == results[torch.float32]


def test_torch_clip_over_the_model_parameters_clips_the_masters_gradients():
    """Row 2: torch's recipe, `unscale_` then `torch.nn.utils.clip_grad_norm_(model.parameters())`, and
    `clip_grad_value_` over the model. First design: it returned 0 and clipped nothing (the update went
    unclipped, silently); issue 45: it raised, naming the scaler's clip. Now (issue 55): the FP16
    parameter's `.grad` reads and writes its master's gradient, so the model's clip is the optimizer's,
    as with FP32 weights: the same norm, the same clipped update. Bug caught: a marker whose reads
    return the stand-in's own (zero) storage, or whose in-place clip writes a copy."""
    results = {}
    for dtype in (torch.float16, torch.float32):
        model = _model(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = DynamicLossScaler(init_scale=2.0**8)
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0)).half()
        half = {n: p if p.dtype == torch.float16 else p.half() for n, p in model.named_parameters()}
        loss = torch.func.functional_call(model, half, (x,)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        torch.nn.utils.clip_grad_value_(model.parameters(), 2e-4)
        per_param = [p.grad.float().norm() for p in model.parameters()]  # a user's per-parameter log
        params = [p for g in opt.param_groups for p in g["params"]]
        before = [p.detach().clone() for p in params]
        scaler.step(opt)
        update = torch.cat([(p.detach() - b).flatten() for p, b in zip(params, before, strict=True)])
        results[dtype] = (norm, torch.stack(per_param), update)
    (n16, p16, u16), (n32, p32, u32) = results[torch.float16], results[torch.float32]
    assert n16 > 1e-3 and torch.equal(n16, n32)
    assert torch.equal(p16, p32) and torch.equal(u16, u32)
    assert 0 < u16.abs().max() <= 0.1 * 2e-4 * 1.001  # lr x clip value: clipped


def test_a_second_optimizer_after_del_trains_and_the_old_masters_are_freed():
    """Row 3: a new phase with a new optimizer (new LR) after `del opt`. Before: a new optimizer that got
    the old one's `id()` was taken for it (its parameters were never swapped: it never trained) and
    the old masters lived forever. Now: the masters belong to their optimizer."""
    model = _model()
    scaler = DynamicLossScaler(init_scale=2.0**8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(_loss(model, 0)).backward()
    scaler.step(opt)
    scaler.update()
    old_master = weakref.ref(opt.param_groups[0]["params"][0])
    old_id = id(opt)
    del opt
    gc.collect()
    assert old_master() is None  # freed with its optimizer
    for _attempt in range(50):  # an optimizer at the old address, as CPython often gives
        opt2 = torch.optim.SGD(model.parameters(), lr=0.05)
        if id(opt2) == old_id:
            break
    model.zero_grad()
    before = _weights(model)
    scaler.scale(_loss(model, 1)).backward()
    scaler.step(opt2)
    scaler.update()
    assert any(not torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_the_optimizer_state_carries_every_master_and_resumes_bitwise(optim):
    """Row 4: `optimizer.state_dict()` with SGD without momentum (the Trainer's `optim="sgd"`, which keeps
    no state) or with a parameter that got no gradient. Before: those masters were missing from the
    state (written only into entries the optimizer had made): the resume restarted them from the FP16
    weights, off by up to half an FP16 ulp. Now: every master is in the state."""

    def make(model):
        params = list(model.parameters())
        if optim == "sgd":
            return torch.optim.SGD(params, lr=1e-3)
        return torch.optim.AdamW(params, lr=1e-3)

    def run(model, opt, scaler, steps):
        for i in steps:
            model[2].bias.requires_grad_(i >= 3)  # a parameter that got no gradient before the checkpoint
            scaler.scale(_loss(model, i)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        model[2].bias.requires_grad_(True)

    full = _model()
    opt = make(full)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    run(full, opt, scaler, range(6))

    cut = _model()
    opt = make(cut)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    run(cut, opt, scaler, range(3))
    buf = io.BytesIO()
    torch.save({"model": cut.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = _model(seed=1)
    resumed.load_state_dict(ckpt["model"])
    opt2 = make(resumed)
    scaler2 = DynamicLossScaler(init_scale=2.0**8)
    scaler2.master_weights.attach(opt2)
    opt2.load_state_dict(ckpt["opt"])
    scaler2.load_state_dict(ckpt["scaler"])
    run(resumed, opt2, scaler2, range(3, 6))
    for a, b in zip(full.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fp16_parameters_added_later_train_on_their_own_masters():
    """Row 6: a layer unfrozen after a phase and added with `add_param_group`. Before: a `ValueError` told
    the user to turn on master weights, which were on. Now it trains (and so does a layer unfrozen
    inside a group the optimizer already had)."""
    model = _model()
    model[2].requires_grad_(False)
    opt = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    scaler.scale(_loss(model, 0)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    model[2].requires_grad_(True)
    opt.add_param_group({"params": list(model[2].parameters()), "lr": 1e-2})
    before = _weights(model)
    scaler.scale(_loss(model, 1)).backward()
    scaler.step(opt)
    scaler.update()
    after = _weights(model)
    assert not torch.equal(before[2], after[2])  # the added layer moved
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])


def test_telemetry_every_step_snapshots_every_step():
    """Row 7: `telemetry_interval=1` gives one snapshot per step. Before: the first step only (the
    telemetry looked before the gradients were handed to the masters, which then had none)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = DynamicLossScaler(init_scale=2.0**8, telemetry_interval=1)
    steps = []
    for i in range(3):
        scaler.scale(_loss(model, i)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        snap = scaler.telemetry.read(only_new=True)
        steps.append(None if snap is None else snap["step"])
    assert steps == [0, 1, 2]


def test_overflow_reports_name_the_model_parameters():
    """Row 8: after `set_parameter_names(model)` an overflow is reported as `2.weight`, as with FP32
    weights. Before: `param_groups[0].params[2] (shape (1, 8))` (the names were keyed by the FP16
    tensors, the optimizer held the masters)."""
    names = {}
    for dtype in (torch.float32, torch.float16):
        model = _model(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = DynamicLossScaler(init_scale=2.0**8)
        scaler.set_parameter_names(model)
        loss = _loss(model, 0) + _NaNGrad.apply(model[2].weight).float().sum() * 0  # its gradient overflows
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        names[dtype] = scaler.overflow_params
    assert names[torch.float32] == ["2.weight"]
    assert names[torch.float16] == names[torch.float32]


def test_a_state_from_an_fp32_phase_is_not_undone_by_stale_masters():
    """Row 10: FP16 weights with masters, then a phase with FP32 weights (the optimizer state keeps the
    unknown master entry), then FP16 again. Before: the first step (even a skipped one) wrote the first
    phase's stale masters into the model and undid the FP32 phase. Now: a master that does not round
    to its weight is rebuilt from it, with a warning that names the parameter."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    scaler.set_parameter_names(model)
    for i in range(2):
        scaler.scale(_loss(model, i)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    phase1 = opt.state_dict()
    # phase 2: the same model in FP32, resumed from phase 1's optimizer state; it trains
    fp32 = _model(torch.float32)
    fp32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    opt32 = torch.optim.AdamW(fp32.parameters(), lr=1e-2)
    opt32.load_state_dict(phase1)
    scaler32 = DynamicLossScaler(init_scale=2.0**8)
    for i in range(2, 5):
        scaler32.scale(_loss(fp32, i)).backward()
        scaler32.step(opt32)
        scaler32.update()
        opt32.zero_grad()
    phase2 = opt32.state_dict()
    # phase 3: FP16 again from phase 2's weights and state; its first step is a skipped one
    back = _model()
    back.load_state_dict({k: v.half() for k, v in fp32.state_dict().items()})
    expected = _weights(back)
    opt3 = torch.optim.AdamW(back.parameters(), lr=1e-2)
    scaler3 = DynamicLossScaler(init_scale=2.0**8)
    scaler3.set_parameter_names(back)
    scaler3.master_weights.attach(opt3)
    opt3.load_state_dict(phase2)
    with pytest.warns(UserWarning, match=r"master loaded for 0\.weight does not round"):
        scaler3.scale(_loss(back, 9, bad="nan")).backward()
        scaler3.step(opt3)
        scaler3.update()
    assert scaler3.last_step_skipped
    for a, b in zip(expected, _weights(back), strict=True):
        assert torch.equal(a, b)  # the FP32 phase's training stands


def test_a_dropped_first_iteration_does_not_skip_the_next_clean_step():
    """Row 11 (FP32 weights too): the first iteration's loss is NaN, the user calls `zero_grad()` and
    `continue`s. torch's scaler steps the next clean iteration. Before: the next step was skipped (no
    sentinel parameter existed yet to tell a dropped probe from accumulation). Now the non-finite loss
    lives in its own gradients (poisoned by its backward), and `zero_grad()` clears it with them."""
    for dtype in (torch.float32, torch.float16):
        for zero in ("optimizer", "model"):
            model = _model(dtype)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler = DynamicLossScaler(init_scale=2.0**8)
            loss = _loss(model, 0, bad="nan")
            scaler.scale(loss).backward()
            (opt if zero == "optimizer" else model).zero_grad()
            scaler.scale(_loss(model, 1)).backward()
            before = _weights(model)
            scaler.step(opt)
            scaler.update()
            assert not scaler.last_step_skipped, (dtype, zero)
            assert scaler.stats()["nonfinite_loss_steps"] == 0
            assert any(not torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))


def test_tied_weights_and_a_parameter_listed_twice_get_one_master():
    emb = torch.nn.Embedding(5, 4).half()
    head = torch.nn.Linear(4, 5, bias=False).half()
    head.weight = emb.weight  # tied, as an LM head to its embeddings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about the duplicate
        opt = torch.optim.SGD([emb.weight, head.weight], lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    out = head(emb(torch.tensor([0, 1, 2]))).float().pow(2).mean()
    scaler.scale(out).backward()
    scaler.step(opt)
    scaler.update()
    params = opt.param_groups[0]["params"]
    assert params[0] is params[1] and params[0].dtype == torch.float32
    assert len(scaler.master_weights.pairs(opt)) == 1
    assert torch.equal(params[0].detach().half(), emb.weight.detach())


def test_a_corrupted_master_in_a_state_is_rebuilt_with_a_warning_naming_it():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    scaler.set_parameter_names(model)
    scaler.scale(_loss(model, 0)).backward()
    scaler.step(opt)
    scaler.update()
    state = opt.state_dict()
    state["state"][2]["hf_lossscale_master"] = state["state"][2]["hf_lossscale_master"] + 1.0  # 2.weight
    opt.zero_grad()
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler2 = DynamicLossScaler(init_scale=2.0**8)
    scaler2.set_parameter_names(model)
    scaler2.master_weights.attach(opt2)
    opt2.load_state_dict(state)
    expected = model[2].weight.detach().float().clone()
    with pytest.warns(UserWarning, match=r"master loaded for 2\.weight does not round"):
        scaler2.scale(_loss(model, 1, bad="inf")).backward()
        scaler2.step(opt2)  # skipped: the weights stay where they were
    assert torch.equal(model[2].weight.detach().float(), expected)


def test_a_state_loaded_before_the_masters_exist_is_refused_with_the_remedy():
    """torch casts a state loaded into FP16 parameters to FP16 (masters and moments): refused, naming
    the call that avoids it, instead of training on on FP16 moments."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    scaler.scale(_loss(model, 0)).backward()
    scaler.step(opt)
    scaler.update()
    state = opt.state_dict()
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt2.load_state_dict(state)  # no attach first
    scaler2 = DynamicLossScaler(init_scale=2.0**8)
    scaler2.scale(_loss(model, 1)).backward()
    with pytest.raises(ValueError, match=r"master_weights\.attach\(optimizer\)"):
        scaler2.step(opt2)


def test_model_weights_loaded_after_the_masters_exist_are_followed():
    """`model.load_state_dict` between steps (a user restoring the best weights): the masters follow the
    new FP16 weights, as an FP32 optimizer steps the weights it is given."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    for i in range(2):
        scaler.scale(_loss(model, i)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    model.load_state_dict(snapshot)
    fresh = _model()
    opt_fresh = torch.optim.SGD(fresh.parameters(), lr=0.1)
    scaler_fresh = DynamicLossScaler(init_scale=scaler.get_scale())
    for m, o, s in ((model, opt, scaler), (fresh, opt_fresh, scaler_fresh)):
        s.scale(_loss(m, 5)).backward()
        s.step(o)
        s.update()
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


class _Regressor(torch.nn.Module):
    """A model whose loss a batch can make non-finite (`bad`: 0 finite, 1 inf, 2 NaN)."""

    def __init__(self, dtype):
        super().__init__()
        self.net = _model(dtype)

    def forward(self, x, bad, labels=None):
        loss = self.net(x.to(next(self.parameters()).dtype)).float().pow(2).mean()
        extra = torch.tensor([0.0, float("inf"), float("nan")])[bad.long()].sum()
        return {"loss": loss + extra}


class _Rows(torch.utils.data.Dataset):
    def __init__(self, bad_rows, n=16):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.bad = torch.zeros(n, dtype=torch.long)
        for i, kind in bad_rows.items():
            self.bad[i] = kind

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "bad": self.bad[i]}


@pytest.mark.parametrize("kind", [1, 2])
def test_the_trainer_with_accumulation_skips_a_step_with_one_nonfinite_micro_batch(tmp_path, kind):
    """Row 1 through the Trainer, `gradient_accumulation_steps=2`: optimizer step 2's first micro-batch
    has an inf/NaN loss. FP32 weights: that step is skipped and counted, the LR held, the scale kept;
    FP16 weights with masters: the same."""
    from hf_lossscale import LossScaleTrainer, LossScaleTrainingArguments

    out = {}
    for dtype in (torch.float32, torch.float16):
        args = LossScaleTrainingArguments(
            str(tmp_path / str(dtype)), fp16=True, max_steps=3, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, report_to=[], disable_tqdm=True, logging_steps=1, seed=0,
            data_seed=0, learning_rate=1e-2, lr_scheduler_type="linear", save_strategy="no",
            loss_scale_init=2.0**8, dataloader_drop_last=True,
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = LossScaleTrainer(
                model=_Regressor(dtype), args=args, train_dataset=_Rows({4: kind, 5: kind})
            )
            trainer.train()
        stats = trainer.loss_scaler.stats()
        lrs = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
        out[dtype] = (stats["skipped_steps"], stats["nonfinite_loss_steps"], stats["loss_scale"], lrs)
    assert out[torch.float32][:3] == (1, 1, 2.0**8), out
    assert out[torch.float16] == out[torch.float32]


def _accelerator():
    """A fresh accelerator (Accelerate's process-wide state reset first) with our scaler installed."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from hf_lossscale import LossScaleConfig, install_loss_scaler

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()

    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    scaler = install_loss_scaler(accelerator, LossScaleConfig(init_scale=2.0**8))
    return accelerator, scaler


@pytest.mark.parametrize("layout", ["two_optimizers", "subset"])
def test_accelerate_clip_with_two_optimizers_or_a_subset_clips_from_the_first_step(layout):
    """Row 5: `accelerator.clip_grad_norm_` over parameters that are not exactly one optimizer's (two
    optimizers, or a subset). FP32: clipped from step 1. Before: the first step went unclipped (the
    masters did not exist yet when the parameters were mapped to them: the clip saw the emptied FP16
    gradients). Now the masters exist from `prepare`."""
    updates = {}
    for dtype in (torch.float32, torch.float16):
        accelerator, scaler = _accelerator()
        model = _model(dtype)
        if layout == "two_optimizers":
            opts = [
                torch.optim.SGD(model[0].parameters(), lr=1.0),
                torch.optim.SGD(model[2].parameters(), lr=1.0),
            ]
            clipped = list(model.parameters())
        else:
            opts = [torch.optim.SGD(model.parameters(), lr=1.0)]
            clipped = list(model[0].parameters())
        model, *opts = accelerator.prepare(model, *opts)
        masters_before = [
            p.detach().clone() for o in opts for g in o.optimizer.param_groups for p in g["params"]
        ]
        accelerator.backward(_loss(model, 0))
        norm = accelerator.clip_grad_norm_(clipped, 1e-3)
        for o in opts:
            o.step()
        after = [p.detach() for o in opts for g in o.optimizer.param_groups for p in g["params"]]
        update = torch.cat(
            [(a.float() - b.float()).flatten() for a, b in zip(after, masters_before, strict=True)]
        )
        updates[dtype] = (float(norm) > 1e-3, float(update.norm()))
    assert updates[torch.float32][0] and updates[torch.float16][0]
    limit = 1e-3 if layout == "two_optimizers" else None
    if limit is not None:  # every parameter clipped: the whole update is lr x max_norm
        assert updates[torch.float32][1] <= limit * 1.001
    assert updates[torch.float16][1] == pytest.approx(updates[torch.float32][1], rel=1e-2, abs=1e-6)


def test_accelerate_save_state_and_load_state_resume_an_fp16_model_with_its_masters(tmp_path):
    """Row 9: `save_state` / `load_state` with a model held in FP16. Before: `ValueError: ... the optimizer
    stepped on FP16 weights` unless an undocumented `master_weights.attach(optimizer)` came first. Now
    `prepare` makes the masters, the state carries them, and the resume lands bitwise on the
    uninterrupted run."""

    def run(model, opt, accelerator, steps):
        for i in steps:
            accelerator.backward(_loss(model, i))
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()

    accelerator, _ = _accelerator()
    full = _model()
    full, opt = accelerator.prepare(full, torch.optim.AdamW(full.parameters(), lr=1e-3))
    run(full, opt, accelerator, range(4))

    accelerator, _ = _accelerator()
    cut = _model()
    cut, opt = accelerator.prepare(cut, torch.optim.AdamW(cut.parameters(), lr=1e-3))
    run(cut, opt, accelerator, range(2))
    accelerator.save_state(str(tmp_path / "state"))
    accelerator, _ = _accelerator()
    resumed = _model(seed=1)
    resumed, opt = accelerator.prepare(resumed, torch.optim.AdamW(resumed.parameters(), lr=1e-3))
    accelerator.load_state(str(tmp_path / "state"))
    run(resumed, opt, accelerator, range(2, 4))
    for a, b in zip(full.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("off", ["mode", "enabled"])
def test_with_scaling_off_an_fp16_model_still_steps_on_its_masters(off):
    """Found by a user trial: with `mode="off"` (or `enabled=False`) `step()` called the optimizer
    directly: an attached optimizer never trained, an unattached one ran pure FP16 AdamW (FP16 moments,
    eps 1e-8 flushed to 0). Masters have nothing to do with scaling: the run is the FP32 one."""
    kwargs = {"mode": "off"} if off == "mode" else {"enabled": False}
    out = {}
    for dtype in (torch.float32, torch.float16):
        model = _model(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = DynamicLossScaler(**kwargs)
        scaler.master_weights.attach(opt)
        for i in range(3):
            scaler.scale(_loss(model, i)).backward()
            scaler.unscale_(opt)
            scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        out[dtype] = [p for g in opt.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in out[torch.float16])
    for a, b in zip(out[torch.float16], out[torch.float32], strict=True):
        assert (a.detach() - b.detach()).abs().max() < 1e-3  # the same training, to FP16 compute's rounding


def test_weights_edited_between_unscale_and_step_are_stepped_from():
    """Found by a user trial: an edit of the FP16 weights after `unscale_` (the gradients already read)
    was overwritten by the step's write-back. FP32: the optimizer steps the edited weights."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    scaler.scale(_loss(model, 0)).backward()
    scaler.unscale_(opt)
    with torch.no_grad():
        model[0].weight.zero_()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(model[0].weight, torch.zeros_like(model[0].weight))


@pytest.mark.parametrize("what", ["own_gradient", "zero_grad_keep"])
@pytest.mark.parametrize("optim", ["sgd_momentum", "adamw", "adamw_fused"])
def test_gradients_put_on_the_parameters_after_unscale_are_stepped_on(what, optim):
    """Found by a user trial (issue 49's review): after `unscale_` the gradients had been read, so a
    gradient given to the FP16 parameter afterwards (a tensor of one's own, or the zeros of
    `optimizer.zero_grad(set_to_none=False)`) never reached its master, and the step skipped the
    parameter (no momentum, no weight decay). FP32 weights step on the new gradient as it is."""
    moved = {}
    for dtype in (torch.float32, torch.float16):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2, bias=False).to(dtype)
        if optim == "sgd_momentum":
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=optim == "adamw_fused" or None)
        scaler = DynamicLossScaler(init_scale=2.0**10)
        for it in range(2):
            scaler.scale(model(torch.ones(3, 4, dtype=dtype)).float().sum()).backward()
            if it == 1:
                scaler.unscale_(opt)
                if what == "own_gradient":
                    model.weight.grad = torch.full_like(model.weight, 0.5)
                else:
                    opt.zero_grad(set_to_none=False)
            before = model.weight.detach().float().clone()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        moved[dtype] = model.weight.detach().float() - before
    assert moved[torch.float32].abs().min() > 1e-3  # the reference moved
    torch.testing.assert_close(moved[torch.float16], moved[torch.float32], atol=2e-3, rtol=0)


def test_marker_metadata_methods_and_sparse_and_fp32_phase():
    """Found by a user trial: `p.grad.size()`/`numel()` on a moved gradient raised; a sparse FP16 embedding
    failed in the hand-over (`copy_() between dense and sparse`); an optimizer that stepped the model in
    FP32 before `model.half()` was refused with a wrong message. Now: metadata reads work, a sparse
    gradient is cast as it is, and the FP32 state becomes the masters' state."""
    emb = torch.nn.Embedding(10, 4, sparse=True).half()
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    before = emb.weight.detach().clone()
    scaler.scale(emb(torch.tensor([1, 2])).float().sum()).backward()
    scaler.unscale_(opt)
    assert emb.weight.grad.size() == (10, 4) and emb.weight.grad.numel() == 40
    scaler.step(opt)
    scaler.update()
    moved = (emb.weight.detach() != before).any(dim=1)
    assert moved.tolist() == [False, True, True] + [False] * 7

    model = _model(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    for i in range(2):
        scaler.scale(_loss(model, i)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    steps = [opt.state[p]["step"].item() for p in model.parameters()]
    model.half()
    scaler.scale(_loss(model, 2)).backward()
    scaler.step(opt)
    scaler.update()
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in masters)
    assert [opt.state[m]["step"].item() for m in masters] == [s + 1 for s in steps]  # the moments went on


def test_accelerate_clip_grad_value_clips_the_masters():
    """`accelerator.clip_grad_value_(model.parameters(), v)` on a model held in FP16 clips the masters'
    gradients (it raised: the FP16 `.grad` is a marker once the gradients moved)."""
    accelerator, _ = _accelerator()
    model = _model()
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    accelerator.backward(_loss(model, 0) * 100)
    accelerator.clip_grad_value_(model.parameters(), 1e-3)
    grads = [p.grad for g in opt.optimizer.param_groups for p in g["params"]]
    assert max(g.abs().max().item() for g in grads) == pytest.approx(1e-3)  # clipped to the value (FP32)
