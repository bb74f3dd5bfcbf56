"""FP32 master weights for a model held in FP16 (issue 39): the optimizer steps on FP32 copies, each
FP16 gradient read once into them, the FP16 weights written back; skips touch nothing; the masters
travel with the optimizer's state."""

import copy

import pytest
import torch

from hf_lossscale import DynamicLossScaler


def _model(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return model.half()


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(4, 6, generator=g).half(), torch.randn(4, 3, generator=g).half()


def _loss(model, i):
    x, y = _batch(i)
    return (model(x).float() - y.float()).pow(2).mean()


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, fused=kind == "fused", foreach=kind == "foreach")


@pytest.mark.parametrize("kind", ["foreach", "fused", "sgd"])
def test_an_fp16_model_trains_on_fp32_masters_like_the_obvious_implementation(kind):
    """Bugs caught: the FP16 weights never written back (training does nothing), the gradients cast
    after unscaling in FP16 (small ones flushed), a skipped step that moved the masters, the masters
    created after the optimizer's state (FP16 moments)."""
    scale = 2.0**10
    model, ref_model = _model(), _model()
    opt = _optimizer(kind, model.parameters())
    scaler = DynamicLossScaler(init_scale=scale, growth_interval=1000, backoff_factor=0.5)
    for i in range(6):
        opt.zero_grad()
        scaler.scale(_loss(model, i)).backward()
        if i == 2:
            next(model.parameters()).grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        if i == 2:  # skipped: neither the FP16 weights nor the masters moved
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            scale_after_skip = scaler.get_scale()
    assert scale_after_skip == scale / 2 and scaler.stats()["skipped_steps"] == 1
    masters = [m for _, m in scaler.master_weights.pairs(opt)]
    assert len(masters) == 4 and all(m.dtype == torch.float32 for m in masters)
    assert all(p.dtype == torch.float16 for p in model.parameters())  # the model keeps FP16 weights
    # the reference at the scales the scaler used: 2^10 until the skip, 2^9 after
    ref = _reference_with_scales(ref_model, kind, [scale] * 3 + [scale / 2] * 3, inf_at=(2,))
    for m, r in zip(masters, ref, strict=True):
        torch.testing.assert_close(m, r, rtol=0, atol=0)
    for p, r in zip(model.parameters(), ref, strict=True):
        assert torch.equal(p, r.half())  # round to nearest even, from the master
    state = opt.state[masters[0]]
    if kind != "sgd":
        assert state["exp_avg"].dtype == torch.float32


def _reference_with_scales(model, kind, scales, inf_at=()):
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = _optimizer(kind, masters)
    for i, scale in enumerate(scales):
        model.zero_grad()
        (_loss(model, i) * scale).backward()
        if i in inf_at:
            next(model.parameters()).grad[0, 0] = float("inf")
        grads = [p.grad.float() * (1.0 / scale) for p in model.parameters()]
        if all(torch.isfinite(g).all() for g in grads):
            for m, g in zip(masters, grads, strict=True):
                m.grad = g
            opt.step()
            with torch.no_grad():
                for p, m in zip(model.parameters(), masters, strict=True):
                    p.copy_(m)
    return masters


def test_frozen_fp16_parameters_get_no_master_and_fp32_ones_step_as_they_are():
    """A PEFT-like model: a frozen FP16 base, a trainable FP16 adapter, an FP32 head. Bug caught: a
    master for the frozen base (memory for nothing), or the FP32 head copied."""
    torch.manual_seed(0)
    base, adapter, head = torch.nn.Linear(6, 6).half(), torch.nn.Linear(6, 6).half(), torch.nn.Linear(6, 2)
    base.requires_grad_(False)
    params = [*adapter.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    scaler = DynamicLossScaler(init_scale=256.0)
    x = torch.randn(3, 6).half()
    head_before = head.weight.detach().clone()
    scaler.scale(head(adapter(base(x)).float()).pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    pairs = scaler.master_weights.pairs(opt)
    assert [h for h, _ in pairs] == list(adapter.parameters())
    assert scaler.master_weights.bytes() == 4 * sum(p.numel() for p in adapter.parameters())
    assert not torch.equal(head.weight, head_before) and head.weight.dtype == torch.float32
    assert any(p is head.weight for g in opt.param_groups for p in g["params"])


def test_master_weights_off_refuses_fp16_parameters_naming_the_setting():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = DynamicLossScaler(master_weights=False)
    scaler.scale(_loss(model, 0)).backward()
    with pytest.raises(ValueError, match="master_weights"):
        scaler.step(opt)


def test_the_masters_travel_with_the_optimizer_state_and_a_resume_is_bitwise():
    """Three steps, the optimizer's and the scaler's state saved, a fresh FP16 model loaded from the
    saved FP16 weights (what a checkpoint holds), masters attached, the states loaded, three more steps:
    the FP16 weights and the masters equal the uninterrupted run's bitwise. Bug caught: masters rebuilt
    from the FP16 weights on resume (their low bits lost)."""

    def run(steps, model, opt, scaler, start=0):
        for i in range(start, start + steps):
            opt.zero_grad()
            scaler.scale(_loss(model, i)).backward()
            scaler.step(opt)
            scaler.update()

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    run(6, model, opt, scaler)

    first = _model()
    opt1 = torch.optim.AdamW(first.parameters(), lr=1e-2)
    scaler1 = DynamicLossScaler(init_scale=2.0**8)
    run(3, first, opt1, scaler1)
    saved = copy.deepcopy((first.state_dict(), opt1.state_dict(), scaler1.state_dict()))

    resumed = _model(seed=1)  # other weights: everything must come from the checkpoint
    resumed.load_state_dict(saved[0])
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    scaler2 = DynamicLossScaler(init_scale=2.0**8)
    assert scaler2.master_weights.attach(opt2) == 4  # the one call before loading an optimizer state
    opt2.load_state_dict(saved[1])
    scaler2.load_state_dict(saved[2])
    run(3, resumed, opt2, scaler2, start=3)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    for (_, a), (_, b) in zip(
        scaler.master_weights.pairs(opt), scaler2.master_weights.pairs(opt2), strict=True
    ):
        assert torch.equal(a, b)


def test_attaching_after_the_optimizer_stepped_in_fp16_is_refused():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _loss(model, 0).backward()
    opt.step()  # FP16 moments now exist
    with pytest.raises(ValueError, match="before the first step"):
        DynamicLossScaler().master_weights.attach(opt)


def test_the_one_pass_clip_reads_the_masters():
    """`scaler.clip_grad_norm_` on an FP16 model: the norm of the unscaled FP32 gradients, clipped."""
    model, twin = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = DynamicLossScaler(init_scale=2.0**12)
    scaler.scale(_loss(model, 0)).backward()
    norm = scaler.clip_grad_norm_(opt, 1e-3)
    _loss(twin, 0).backward()
    expected = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in twin.parameters()])
    )
    torch.testing.assert_close(norm, expected, rtol=2e-3, atol=0)
    masters = [m for _, m in scaler.master_weights.pairs(opt)]
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in masters]))
    assert clipped <= 1e-3 * (1 + 1e-4)
    scaler.step(opt)
    scaler.update()


def _trainer(tmp_path, model, **kw):
    from tiny_models import tiny_classification_dataset

    from hf_lossscale import LossScaleTrainer, LossScaleTrainingArguments

    args = LossScaleTrainingArguments(
        str(tmp_path), fp16=True, max_steps=4, per_device_train_batch_size=4, report_to=[], disable_tqdm=True,
        logging_steps=1, seed=0, data_seed=0, max_grad_norm=1.0, **kw,
    )  # fmt: skip
    return LossScaleTrainer(model=model, args=args, train_dataset=tiny_classification_dataset())


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_the_trainer_trains_an_fp16_model_on_masters_and_resumes_bitwise(tmp_path, optim):
    """`LossScaleTrainer(fp16=True)` on a tiny BERT held in FP16 (what `from_pretrained(dtype=torch.float16)`
    gives): it trains with the optimizer the Trainer builds, clips through the masters, checkpoints
    the masters with the optimizer, and a resume from step 2 lands bitwise on the uninterrupted run;
    `save_pretrained` writes FP16. Bugs caught: "Attempting to unscale FP16 gradients" (or our refusal);
    the clip reading the emptied FP16 gradients (grad_norm 0, nothing clipped); masters rebuilt from the
    FP16 checkpoint on resume; FP16 moments loaded into FP16 parameters before the masters existed."""
    import warnings

    from safetensors.torch import load_file
    from tiny_models import tiny_bert_classifier

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = _trainer(tmp_path / "full", tiny_bert_classifier().half(), optim=optim, save_strategy="no")
        full.train()
        first = _trainer(tmp_path / "cut", tiny_bert_classifier().half(), optim=optim, save_strategy="steps",
                         save_steps=2)  # fmt: skip
        first.train()
        resumed = _trainer(
            tmp_path / "cut", tiny_bert_classifier(seed=1).half(), optim=optim, save_strategy="no"
        )
        resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-2"))
    model = full.model
    assert all(p.dtype == torch.float16 for p in model.parameters())
    norms = [e["grad_norm"] for e in full.state.log_history if "grad_norm" in e]
    assert any(n > 0 for n in norms[1:]), norms  # the clip saw the gradients (the masters')
    for a, b in zip(model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
    masters = [m for _, m in full.loss_scaler.master_weights.pairs(full.optimizer)]
    again = [m for _, m in resumed.loss_scaler.master_weights.pairs(resumed.optimizer)]
    assert len(masters) == len(again) > 0 and all(
        torch.equal(a, b) for a, b in zip(masters, again, strict=True)
    )
    full.save_model(str(tmp_path / "deploy"))
    assert {t.dtype for t in load_file(str(tmp_path / "deploy" / "model.safetensors")).values()} == {
        torch.float16
    }


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_master_weights_add_no_host_read(kind):
    """Steps with master weights, one of them skipped, counted as the sync tests count (every way a
    device value reaches the host): the same reads as the same steps on an FP32 model (fused: 0,
    foreach: 1 per step, the skip decision). Bug caught: an `isfinite().all()` or a `.item()` per
    tensor in the hand-over, or a host check of the skip before writing the FP16 weights back."""
    from sync_count import count_reads

    def reads(model):
        dtype = next(model.parameters()).dtype

        def _loss(model, i):  # the batch in the model's dtype
            x, y = _batch(i)
            return (model(x.to(dtype)).float() - y.float()).pow(2).mean()

        opt = _optimizer(kind, model.parameters())
        scaler = DynamicLossScaler(init_scale=2.0**10)
        scaler.scale(_loss(model, 0).float()).backward()  # lazy init and the masters outside the count
        scaler.step(opt)
        scaler.update()

        def steps():
            for i in range(1, 4):
                opt.zero_grad()
                model.zero_grad()
                scaler.scale(_loss(model, i).float()).backward()
                if i == 2:
                    next(model.parameters()).grad[0, 0] = float("inf")
                scaler.step(opt)
                scaler.update()

        return count_reads(steps)

    assert reads(_model()) == reads(_model().float())


def test_bf16_parameters_under_the_fp16_scaler_get_one_message_before_the_step():
    """torch fails deep in a kernel ("_amp_foreach_non_finite_check_and_unscale_cuda" not implemented
    for 'BFloat16', pytorch #127176, trl #4901). Bug caught: that error, or BF16 stepped unscaled."""
    model = torch.nn.Linear(4, 2).bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = DynamicLossScaler()
    scaler.set_parameter_names(model)
    before = model.weight.detach().clone()
    scaler.scale(model(torch.randn(3, 4).bfloat16()).float().sum()).backward()
    with pytest.raises(ValueError, match=r"held in bfloat16: weight, bias.*bf16=True"):
        scaler.step(opt)
    assert torch.equal(model.weight, before)


def test_compare_runs_the_master_weights_setting(tmp_path, capsys):
    """`compare --settings fp32,master`: the recipe loads the model in FP16 (`--dtype float16`) and the
    Trainer steps it on FP32 masters with dynamic scaling; the run finishes and is judged like any
    setting. Bug caught: the setting's flags not reaching the recipe (an FP32 model under its name), or
    the FP16 model refused."""
    import json

    from tiny_models import run_tiny_compare

    from hf_lossscale.core.events import read_run_events
    from hf_lossscale.tools.runs import setting_flags

    assert setting_flags("master", 2.0**24, "emulate")[-4:] == [
        "--dtype",
        "float16",
        "--loss_scale_master_weights",
        "true",
    ]
    code, out = run_tiny_compare(tmp_path, "fp32,master")
    captured = capsys.readouterr()
    assert code == 0, captured.out[-3000:] + captured.err[-3000:]
    row = next(
        line for line in (out / "summary.md").read_text().splitlines() if line.startswith("| FP16 weights")
    )
    assert row.rstrip(" |").endswith("ok"), row
    start = next(
        e
        for e in read_run_events(out / "runs" / "master-seed0" / "loss_scale_log.jsonl")
        if e["event"] == "run_start"
    )
    assert start["loss_scale_config"]["master_weights"] is True
    assert json.loads((out / "metrics.json").read_text())["runs"][1]["setting"] == "master"


def test_compare_runs_fp16_weights_without_masters(tmp_path, capsys):
    """`compare --settings pure`: the model held in FP16 and stepped by the optimizer in FP16, with no
    scaler and no masters (what users do when they force FP16 weights). Bug caught: the setting
    silently running FP32 weights (its parameters never FP16), or a scaler under it."""
    from tiny_models import run_tiny_compare

    from hf_lossscale.core.events import read_run_events

    code, out = run_tiny_compare(tmp_path, "pure")
    captured = capsys.readouterr()
    assert code == 0, captured.out[-3000:] + captured.err[-3000:]
    start = next(
        e
        for e in read_run_events(out / "runs" / "pure-seed0" / "loss_scale_log.jsonl")
        if e["event"] == "run_start"
    )
    assert start["loss_scale_config"] is None, start
    assert list(start["trainable_param_dtypes"]) == ["torch.float16"], start


@pytest.mark.cuda
def test_cuda_master_weights_add_no_sync():
    """An FP16 model on CUDA with fused AdamW on FP32 masters, one step skipped, under
    `set_sync_debug_mode("error")` (run by benchmarks/gpu_check.sh, step 1): the hand-over, the step
    and the write-back never wait for the GPU."""
    model = _model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = DynamicLossScaler(init_scale=2.0**10, telemetry_interval=0)

    batches = [[t.cuda() for t in _batch(i)] for i in range(5)]  # host-to-device copies sync: made before

    def step(i):
        x, y = batches[i]
        scaler.scale((model(x).float() - y.float()).pow(2).mean()).backward()
        if i == 3:  # `grad[0] = inf` would copy the value from the host (a sync); fill_ launches a kernel
            next(model.parameters()).grad.view(-1)[:1].fill_(float("inf"))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    for i in range(2):  # warm up: the masters, the optimizer state, lazy init
        step(i)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(2, 5):
            step(i)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert scaler.stats()["skipped_steps"] == 1 and all(p.dtype == torch.float16 for p in model.parameters())
