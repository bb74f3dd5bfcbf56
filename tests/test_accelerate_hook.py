import copy
import warnings

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from tiny_models import tiny_mlp

from hf_lossscale import DynamicLossScaler, LossScaleConfig, install_loss_scaler
from hf_lossscale.integrations.accelerate_hook import LossScaledOptimizer
from hf_lossscale.integrations.compat import accelerate_has_4242


def run(order, optimizer="adamw_fused", steps=5, bad=(2,), clip=True, fp16_on_cpu="native"):
    acc = Accelerator(mixed_precision="fp16")
    assert acc.device.type == "cpu" and acc.scaler is None and not acc.native_amp  # what Accelerate does
    model = tiny_mlp()
    if optimizer == "adamw_fused":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    dtypes = []
    # the dtype FP16 compute really held: real float16, or float32 tagged as emulated FP16
    model[0].register_forward_hook(
        lambda m, i, o: dtypes.append(torch.float16 if getattr(o, "_hf_fp16", False) else o.dtype)
    )
    config = LossScaleConfig(init_scale=2.0**10, fp16_on_cpu=fp16_on_cpu)
    if order == "before":
        scaler = install_loss_scaler(acc, config)
    model, opt = acc.prepare(model, opt)
    if order == "after":
        scaler = install_loss_scaler(acc, config)
    g = torch.Generator().manual_seed(0)
    history = []
    for step in range(steps):
        x = torch.randn(16, 4, generator=g)
        before = copy.deepcopy(acc.unwrap_model(model).state_dict())
        out = model(x)
        loss = out.pow(2).mean()
        if step in bad:
            loss = loss * float("inf")
        acc.backward(loss)
        if clip:
            acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        unchanged = all(torch.equal(v, acc.unwrap_model(model).state_dict()[k]) for k, v in before.items())
        history.append(
            (out.dtype, dtypes[-1], opt.step_was_skipped, acc.optimizer_step_was_skipped, unchanged)
        )
    return acc, scaler, model, opt, history


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("optimizer", ["adamw_fused", "sgd"])
@pytest.mark.parametrize("fp16_on_cpu", ["native", "emulate"])
def test_cpu_fp16_install_before_or_after_prepare(order, optimizer, fp16_on_cpu):
    acc, scaler, model, opt, history = run(order, optimizer, fp16_on_cpu=fp16_on_cpu)
    assert acc.scaler is scaler and acc.native_amp
    assert acc.hf_lossscale.fp16 == {"native": "native-cpu", "emulate": "emulated"}[fp16_on_cpu]
    assert acc.hf_lossscale.scaler is scaler and opt.scaler is scaler
    assert isinstance(opt, LossScaledOptimizer) == accelerate_has_4242()
    assert opt in acc._optimizers  # the optimizer prepare() returned is the one Accelerate steps and saves
    # Accelerate's own autocast and backward (native_amp on), also under the emulation
    assert "autocast" not in vars(acc) and "backward" not in vars(acc)
    for step, (out_dtype, inner_dtype, skipped, acc_skipped, unchanged) in enumerate(history):
        assert inner_dtype == torch.float16  # real FP16 compute on the CPU
        assert out_dtype == torch.float32  # outputs converted back, as Accelerate does on GPUs
        assert skipped == acc_skipped == (step == 2)  # right with the fused optimizer too
        assert unchanged == (step == 2)
    st = scaler.stats()
    # the injected overflow is in the loss (a forward overflow): skipped and counted, the scale kept
    assert (st["total_steps"], st["skipped_steps"], st["loss_scale"]) == (5, 1, 2.0**10)
    assert st["nonfinite_loss_steps"] == 1


def test_clip_sees_unscaled_gradients():
    acc = Accelerator(mixed_precision="fp16")
    scaler = install_loss_scaler(acc, LossScaleConfig(init_scale=2.0**12, fp16_on_cpu="native"))
    model = tiny_mlp()
    reference = copy.deepcopy(model)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(8, 4)
    acc.backward(model(x).pow(2).mean())
    norm = acc.clip_grad_norm_(model.parameters(), 1e9)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = reference(x).float().pow(2).mean()
    (loss * 2.0**12).backward()  # the same FP16 backward at the same scale, unscaled by hand
    for p in reference.parameters():
        p.grad.mul_(2.0**-12)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
    assert scaler.get_scale() == 2.0**12
    # bitwise: unscaling by a power of two is exact and the norm is torch's own computation (a 4096x
    # larger norm, the scaled one, or a norm computed another way would differ)
    assert torch.equal(norm, ref_norm), (norm, ref_norm)


def test_accumulate_steps_only_on_sync_steps():
    acc = Accelerator(mixed_precision="fp16", gradient_accumulation_steps=4)
    scaler = install_loss_scaler(acc, LossScaleConfig(init_scale=2.0**8))
    model = tiny_mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _i in range(8):
        with acc.accumulate(model):
            acc.backward(model(torch.randn(4, 4)).pow(2).mean())
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    assert scaler.stats()["total_steps"] == 2


def test_save_and_load_state_round_trip(tmp_path):
    acc, scaler, model, opt, _ = run("before", steps=4, bad=(1,))
    acc.save_state(tmp_path / "ckpt")
    saved = scaler.state_dict()
    scaler.update(new_scale=3.0)
    acc.load_state(tmp_path / "ckpt")
    assert acc.scaler.state_dict() == saved


def test_load_state_follows_the_resume_rule(tmp_path, caplog):
    """`accelerator.load_state` with our scaler resumes as the Trainer does (issue 48 item 3): every
    setting from this run's config, the scale and counters from the checkpoint, one line naming what
    differs, none of the scaler's own config warnings. A plain `load_state_dict` keeps torch's
    semantics (the checkpoint's growth_interval). Bugs caught: a hook resume keeping the checkpoint's
    growth_interval 3 while taking hysteresis from this run (the mixed sources issue 48 found), a
    rule that also rewrites plain `load_state_dict`, a silent resume."""
    import logging

    acc, scaler, model, opt, _ = run("before", steps=4, bad=(1,))
    scaler.set_growth_interval(3)
    acc.save_state(tmp_path / "ckpt")
    saved = scaler.stats()
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    acc2 = Accelerator(mixed_precision="fp16")
    scaler2 = install_loss_scaler(acc2, LossScaleConfig(init_scale=2.0**4, growth_interval=7, hysteresis=2))
    acc2.prepare(tiny_mlp(), torch.optim.AdamW(tiny_mlp().parameters(), lr=1e-2, fused=True))
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        warnings.simplefilter("error")  # the scaler's own "restored from the state" warnings: replaced
        acc2.load_state(tmp_path / "ckpt")
    assert scaler2.config.growth_interval == 7 and scaler2.config.hysteresis == 2
    assert scaler2.stats()["loss_scale"] == saved["loss_scale"] and scaler2.stats()["skipped_steps"] == 1
    lines = [r.getMessage() for r in caplog.records if "resumed the loss scaler" in r.getMessage()]
    assert len(lines) == 1 and "growth_interval 7 (checkpoint 3)" in lines[0]
    with pytest.warns(UserWarning, match="Restored from the loss-scaler state"):
        scaler2.load_state_dict(scaler.state_dict())  # torch's semantics, outside load_state
    assert scaler2.config.growth_interval == 3


def test_no_op_with_warning_for_bf16_and_fp32():
    for mp in ("no", "bf16"):
        acc = Accelerator(mixed_precision=mp)
        with pytest.warns(UserWarning, match="not 'fp16'"):
            assert install_loss_scaler(acc) is None
        assert acc.scaler is None
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)


def test_environment_configures_the_scaler(tmp_path, monkeypatch):
    path = tmp_path / "ls.yaml"
    path.write_text("init_scale: 1024.0\nhysteresis: 3\nmin_scale: 2.0\n")
    monkeypatch.setenv("HF_LOSSSCALE_CONFIG", str(path))
    monkeypatch.setenv("HF_LOSSSCALE_MIN_SCALE", "8")
    acc = Accelerator(mixed_precision="fp16")
    scaler = install_loss_scaler(acc)
    assert (scaler.config.init_scale, scaler.config.hysteresis, scaler.config.min_scale) == (1024.0, 3, 8.0)
    # explicit config in code beats everything
    assert install_loss_scaler(acc, LossScaleConfig()).config == LossScaleConfig()


def test_no_global_patching():
    """`install_loss_scaler` and a training step change one Accelerator and its optimizers, never a
    class or a module. Bug caught: routing `clip_grad_norm_` or the optimizer step by patching
    `Accelerator` / `AcceleratedOptimizer` / torch's classes, which would hand every other
    Accelerator in the process to our scaler."""
    import accelerate.accelerator
    import accelerate.optimizer
    import torch.amp

    watched = [Accelerator, AcceleratedOptimizer, torch.amp.GradScaler, torch.optim.SGD, torch.optim.Optimizer,
               accelerate.accelerator, accelerate.optimizer, torch.amp]  # fmt: skip
    # torch wraps an optimizer class's `step` (for its hooks) when the class is first instantiated:
    # that happens before the snapshot, so what remains is ours.
    torch.optim.SGD(tiny_mlp().parameters(), lr=0.1)
    before = [dict(vars(obj)) for obj in watched]
    acc = Accelerator(mixed_precision="fp16")
    install_loss_scaler(acc)
    model, opt = acc.prepare(tiny_mlp(), torch.optim.SGD(tiny_mlp().parameters(), lr=0.1))
    acc.backward(model(torch.randn(4, 4)).sum())
    acc.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    after = [dict(vars(obj)) for obj in watched]
    for obj, old, new in zip(watched, before, after, strict=True):
        changed = sorted(k for k in old.keys() | new.keys() if old.get(k) is not new.get(k))
        assert not changed, f"{getattr(obj, '__name__', obj)}: {changed}"
    other = Accelerator(mixed_precision="fp16")
    assert not isinstance(other.scaler, DynamicLossScaler)
    assert "clip_grad_norm_" not in vars(other) and "clip_grad_norm_" in vars(acc)  # the instance, only
    assert (
        type(AcceleratedOptimizer(torch.optim.SGD(tiny_mlp().parameters(), lr=0.1))) is AcceleratedOptimizer
    )


def test_grad_scaler_kwargs_seed_the_config_and_explicit_settings_win(monkeypatch):
    """Accelerate's own handler is honoured (issue 48): `GradScalerKwargs(init_scale=1024,
    growth_interval=10, backoff_factor=0.25)` gives a scaler with those, one line saying so; a field the
    loss-scale config sets itself (here through HF_LOSSSCALE_BACKOFF_FACTOR) wins and is named.
    Bug caught: our defaults (65536 / 2000 / 0.5) replacing the user's handler."""
    from accelerate.utils import GradScalerKwargs

    kwargs = GradScalerKwargs(init_scale=1024.0, growth_interval=10, backoff_factor=0.25)
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[kwargs])
    with pytest.warns(
        UserWarning, match=r"GradScalerKwargs taken: init_scale=1024.0, backoff_factor=0.25, growth"
    ):
        scaler = install_loss_scaler(acc)
    assert (scaler.config.init_scale, scaler.config.growth_interval, scaler.config.backoff_factor) == (
        1024,
        10,
        0.25,
    )
    monkeypatch.setenv("HF_LOSSSCALE_BACKOFF_FACTOR", "0.125")
    with pytest.warns(
        UserWarning, match=r"config wins for: backoff_factor \(GradScalerKwargs 0.25, config 0.125\)"
    ):
        scaler = install_loss_scaler(acc)
    assert (scaler.config.init_scale, scaler.config.backoff_factor) == (1024, 0.125)
    monkeypatch.delenv("HF_LOSSSCALE_BACKOFF_FACTOR")
    with warnings.catch_warnings():  # the same values given twice: nothing to say about them
        warnings.simplefilter("error")
        install_loss_scaler(
            Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)]),
            LossScaleConfig(init_scale=1024.0),
        )


def test_torch_signature_builds_the_same_scaler():
    """torch's positional call `GradScaler("cuda", 2.**16, 2.0, 0.5, 2000, True)` and
    `GradScaler("cuda", enabled=False)` work on ours (issue 48); before, `TypeError: config must be a
    LossScaleConfig, got str`."""
    a = DynamicLossScaler("cpu", 2.0**12, 4.0, 0.25, 7, True)
    assert (a.config.init_scale, a.config.growth_factor, a.config.backoff_factor, a.config.growth_interval) == (
        2.0**12, 4.0, 0.25, 7,
    )  # fmt: skip
    assert a.device == torch.device("cpu") and a.is_enabled()
    assert not DynamicLossScaler("cuda", enabled=False).is_enabled()  # off: no CUDA needed
    assert DynamicLossScaler(init_scale=8.0, device="cpu").config.init_scale == 8.0
    assert DynamicLossScaler(LossScaleConfig(min_scale=4.0), 64.0).config.min_scale == 4.0
    with pytest.raises(TypeError, match="multiple values|twice"):
        DynamicLossScaler("cpu", 8.0, init_scale=16.0)


def test_scaler_type():
    acc = Accelerator(mixed_precision="fp16")
    assert isinstance(install_loss_scaler(acc), DynamicLossScaler)


@pytest.mark.parametrize("engine", ["DEEPSPEED", "MEGATRON_LM"])
def test_engines_that_own_their_scaler_are_refused(engine):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    fake = SimpleNamespace(distributed_type=getattr(DistributedType, engine))
    with pytest.raises(RuntimeError, match="owns its loss scaler.*fp16` section"):
        install_loss_scaler(fake)


def test_skip_flag_is_read_once_per_step():
    from sync_count import count_reads

    acc, scaler, model, opt, history = run("before", "adamw_fused", steps=3, bad=(2,))
    assert count_reads(lambda: [opt.step_was_skipped for _ in range(3)]) == 0  # read when run() asked
    assert opt.step_was_skipped is True and acc.optimizer_step_was_skipped is True


@pytest.mark.parametrize("optimizer", ["sgd", "adamw_fused"])
def test_clip_grad_norm_is_routed_and_equals_accelerates_own(optimizer, monkeypatch):
    """`accelerator.clip_grad_norm_` goes through `DynamicLossScaler.clip_grad_norm_` and returns
    what Accelerate's own method returns (unscale_gradients + torch's clip), step by step, over a
    run with a skipped step. Bug caught: the scaled norm returned, the found-inf flag lost (the
    overflowing step applied), other optimizers left scaled, or a routing that never happens."""

    def train(routed):
        acc = Accelerator(mixed_precision="fp16")
        scaler = install_loss_scaler(acc, LossScaleConfig(init_scale=2.0**10, fp16_on_cpu="emulate"))
        calls = []
        clip = scaler.clip_grad_norm_
        monkeypatch.setattr(scaler, "clip_grad_norm_", lambda *a, **k: calls.append(1) or clip(*a, **k))
        if not routed:
            acc.clip_grad_norm_ = Accelerator.clip_grad_norm_.__get__(acc)  # Accelerate's own
        model = tiny_mlp()
        kind = {"sgd": {"momentum": 0.9}, "adamw_fused": {"fused": True}}[optimizer]
        opt_cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
        model, opt = acc.prepare(model, opt_cls(model.parameters(), lr=1e-2, **kind))
        g = torch.Generator().manual_seed(0)
        norms, skips = [], []
        for step in range(6):
            loss = model(torch.randn(16, 4, generator=g)).pow(2).mean() * 50
            acc.backward(loss * float("inf") if step == 3 else loss)
            norms.append(acc.clip_grad_norm_(model.parameters(), 0.5).item())
            opt.step()
            opt.zero_grad()
            skips.append(acc.optimizer_step_was_skipped)
        params = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
        return norms, skips, params, len(calls)

    ours, theirs = train(routed=True), train(routed=False)
    assert ours[3] == 6 and theirs[3] == 0
    assert ours[1] == theirs[1] == [False, False, False, True, False, False]
    assert any(n > 0.5 for n in theirs[0][:3])  # it clips
    if optimizer == "sgd":  # bitwise
        assert ours[0][:3] == theirs[0][:3] and ours[0][4:] == theirs[0][4:]
        assert all(torch.equal(a, b) for a, b in zip(ours[2], theirs[2], strict=True))
    else:  # the fused kernel's divisor: within an ulp per step
        torch.testing.assert_close(ours[0][4:], theirs[0][4:], rtol=1e-5, atol=0)
        for a, b in zip(ours[2], theirs[2], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert not torch.isfinite(torch.tensor(ours[0][3])) and not torch.isfinite(torch.tensor(theirs[0][3]))


def test_clip_of_a_parameter_subset_uses_accelerates_path():
    """A subset of one optimizer's parameters: Accelerate's own path (every gradient unscaled, the
    subset's norm), not ours (which clips exactly what one optimizer steps)."""
    acc = Accelerator(mixed_precision="fp16")
    scaler = install_loss_scaler(acc, LossScaleConfig(init_scale=2.0**4))
    model = tiny_mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(model(torch.randn(8, 4)).pow(2).mean())
    first = list(acc.unwrap_model(model)[0].parameters())
    unscaled = [p.grad / 2.0**4 for p in acc.unwrap_model(model).parameters()]
    assert torch.equal(acc.clip_grad_norm_(first, 1e9), torch.nn.utils.get_total_norm(unscaled[:2]))
    assert all(
        torch.equal(p.grad, u) for p, u in zip(acc.unwrap_model(model).parameters(), unscaled, strict=True)
    )
    opt.step()
    assert scaler.stats()["total_steps"] == 1


@pytest.mark.parametrize("optimizer", ["sgd", "adamw_fused"])
def test_step_was_skipped_reads_the_device_only_for_fused_kernels(optimizer):
    """Non-fused: `scaler.step()` already read the flag, so `step_was_skipped` costs no read.
    Fused: one read, the first time it is asked. Bug caught: the extra sync per step under
    Accelerate and the Trainer with non-fused optimizers."""
    from sync_count import count_reads

    acc, scaler, model, opt, history = run("before", optimizer, steps=2, bad=())
    for bad in (False, True, False):
        loss = model(torch.randn(4, 4)).pow(2).mean()
        acc.backward(loss * float("inf") if bad else loss)
        opt.step()
        opt.zero_grad()
        reads = count_reads(lambda: opt.step_was_skipped)
        assert reads == (1 if optimizer == "adamw_fused" else 0)
        assert opt.step_was_skipped is bad and count_reads(lambda: opt.step_was_skipped) == 0


def test_the_members_of_the_accelerator_the_hook_sets():
    """Issue 56: what `install_loss_scaler` and `prepare()` change on the one `Accelerator`, by comparing its
    instance attributes before and after. On a CPU with emulated FP16: the scaler slot, our namespace,
    `native_amp`, the two `prepare_*` and `clip_grad_norm_` (6, as with native CPU FP16: the emulated
    backward is the scaled loss's, `core.scaled_loss`; `clip_grad_value_` needs no wrapper since the FP16
    parameters' `.grad` reads the masters'). Bug caught: a new member patched without anyone deciding to
    (each one is a place Accelerate's own code can be bypassed)."""
    from accelerate import Accelerator

    from hf_lossscale import install_loss_scaler

    acc = Accelerator(mixed_precision="fp16", cpu=True)
    before = {k: v for k, v in vars(acc).items()}
    install_loss_scaler(acc)
    model = torch.nn.Linear(2, 2).half()
    acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    changed = sorted(k for k, v in vars(acc).items() if k not in before or before[k] is not v)
    bookkeeping = {"_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects", "step",
                   "_load_model_state_pre_hook", "_save_model_state_pre_hook", "flag_tensor"}  # fmt: skip
    assert [k for k in changed if k not in bookkeeping] == [
        "clip_grad_norm_", "hf_lossscale", "native_amp", "prepare_model", "prepare_optimizer", "scaler",
    ]  # fmt: skip


@pytest.mark.parametrize("reentrant", [False, True])
def test_emulated_backward_recomputes_checkpointed_layers_emulated(reentrant):
    """Emulated CPU FP16 through `accelerator.backward`, which the hook leaves as Accelerate's: the scaled
    loss runs its backward under the emulation (`core.scaled_loss`), so a checkpointed model's gradients
    are bitwise those of the run without checkpointing. Bug caught: the backward outside the emulation
    (the scaler's backward context not set, or the scaled loss's backward not under it): the recompute is
    plain FP32 and, reentrant, its gradients are not rounded (far fewer flush)."""
    from tiny_models import tiny_bert_config
    from transformers import BertForMaskedLM

    grads = []
    for checkpointing in (False, True):
        acc = Accelerator(mixed_precision="fp16", cpu=True)
        install_loss_scaler(acc, LossScaleConfig(init_scale=1.0, fp16_on_cpu="emulate"))
        torch.manual_seed(0)
        cfg = tiny_bert_config(vocab_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = BertForMaskedLM(cfg).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        batch = {"input_ids": torch.randint(0, 64, (2, 16)), "labels": torch.randint(0, 64, (2, 16))}
        acc.backward(model(**batch).loss * 1e-3)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert 0.2 < (grads[0] == 0).float().mean() < 0.6  # the emulation flushes some: the test can see it
    assert torch.equal(grads[0], grads[1])


def test_emulated_forward_under_accelerators_own_autocast():
    """Under emulated CPU FP16 `accelerator.autocast()` is Accelerate's (torch's CPU FP16 autocast): code
    of the user's own under it computes in real FP16, and a prepared model called under it is emulated,
    not real FP16 (its forward turns CPU autocast off inside). Bug caught: the model's forward computing
    in real FP16 on top of the emulation (~20x slower, and not the CUDA policy emulated)."""
    acc = Accelerator(mixed_precision="fp16", cpu=True)
    install_loss_scaler(acc, LossScaleConfig(fp16_on_cpu="emulate"))
    model = tiny_mlp()
    inner = []
    model[0].register_forward_hook(lambda m, i, o: inner.append((o.dtype, getattr(o, "_hf_fp16", False))))
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 4)
    with acc.autocast():
        out = model(x)
        own = x @ x.T
    assert inner == [(torch.float32, True)]  # emulated: FP32 storage, tagged FP16
    assert out.dtype == torch.float32 and own.dtype == torch.float16
    model(x)
    assert inner[-1] == (torch.float32, True)  # the same without Accelerate's autocast around it
