"""Master weights on the paths users bring from the rest of the ecosystem (issue 55), each against a
reference that is right by construction: the same model with FP32 weights computing in FP16
(tests/master_twin.py), or, where the path only re-arranges the same arithmetic (gradient
checkpointing, `torch.compile` with eager kernels), the same FP16 model without it.

- other optimizers (torch's Adagrad, RMSprop, NAdam, RAdam, Adamax, AMSGrad, Adadelta, ASGD, Rprop,
  Nesterov SGD, transformers' Adafactor, a user's Lion) in generated programs (the plain-torch
  differential's operations: accumulation, clipping over the model's parameters, `clip_grad_value_`,
  per-parameter norm logs, zeroing styles, save/load, new optimizers, freezing);
- the Trainer's `optim=` names that install without bitsandbytes;
- what reads `.grad`: tensor hooks, post-accumulate hooks, EMA (`AveragedModel`), tied embeddings;
- the lifecycle: `model.float()` and `.to(torch.bfloat16)` mid-run, deepcopy and pickle after a
  backward, an optimizer state carried into an FP32 model, schedule-free's `eval()`/`train()`;
- refusals by name: a closure (LBFGS), LOMO.
"""

from __future__ import annotations

import copy
import io
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from master_twin import CONFIG, OTHER_OPTIMIZERS, SHAPES, Module, Side, batch, check, initial_values
from test_master_differential import iteration, run_program

from hf_lossscale import DynamicLossScaler

EXAMPLES = int(os.environ.get("HF_LOSSSCALE_DIFF_EXAMPLES", "60"))

programs = st.fixed_dictionaries({
    "opt": st.sampled_from(sorted(OTHER_OPTIMIZERS)),
    "first": st.sampled_from((["w1", "b1", "w2"], ["w1", "b1"])),
    "iterations": st.lists(iteration, min_size=1, max_size=6),
})  # fmt: skip


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(programs)
def test_other_optimizers_train_an_fp16_model_on_masters_as_the_fp32_reference(prog):
    """Bug caught: an optimizer whose state is made in its constructor in the parameter's dtype (Adagrad:
    its `sum` was FP16 and the masters refused it), one that reads the masters' `.grad` as stand-ins."""
    run_program(prog)


@pytest.mark.parametrize("kind", sorted(OTHER_OPTIMIZERS))
def test_each_other_optimizer_steps_and_resumes_as_the_reference(kind):
    """Every optimizer in the list, through skips and a save/load into fresh objects (the generated test
    draws them; this makes each one run)."""
    values = initial_values()
    sub = Side(torch.float16, kind, ["w1", "b1", "w2"], values)
    ref = Side(torch.float32, kind, ["w1", "b1", "w2"], values)
    for step, bad in enumerate(
        ["finite", "finite", "grad_inf", "finite", "loss_nan", "finite", "save", "finite"]
    ):
        if bad == "save":
            for side in (sub, ref):
                side.save_load()
            continue
        for side in (sub, ref):
            side.backward(batch(step + 1, bad))
            side.scaler.step(side.optimizers[0])
            side.scaler.update()
            side.optimizers[0].zero_grad()
        check(sub, ref, f"{kind} step {step}", grads=False)
    assert sub.scaler.stats()["skipped_steps"] == 2
    moved = [not torch.equal(sub.params[n].detach(), initial_values()[n]) for n in SHAPES]
    assert all(moved)


# ---------------------------------------------------------------------- the Trainer's optim= names
#: Every `optim=` of transformers' Trainer that installs without bitsandbytes, and what it needs.
TRAINER_OPTIMS = {
    "adamw_torch": None, "adamw_torch_fused": None, "sgd": None, "adagrad": None, "rmsprop": None,
    "adafactor": None, "schedule_free_adamw": "schedulefree", "schedule_free_radam": "schedulefree",
    "schedule_free_sgd": "schedulefree", "stable_adamw": "optimi", "grokadamw": "grokadamw",
    "adamw_torch_4bit": "torchao", "adamw_torch_8bit": "torchao",
}  # fmt: skip


@pytest.mark.parametrize("optim", sorted(TRAINER_OPTIMS))
def test_each_trainer_optim_trains_an_fp16_model_on_masters_as_the_fp32_reference(tmp_path, optim):
    """The Trainer with `optim=...`, a model held in FP16 against FP32 weights computing in FP16, with an
    overflow and a resume from a checkpoint. (`adamw_torch_4bit`/`8bit`: the twin's tensors are below
    torchao's quantisation threshold, so this checks the wiring, not the low-bit state.)"""
    if TRAINER_OPTIMS[optim]:
        pytest.importorskip(TRAINER_OPTIMS[optim])
    from test_master_differential_integrations import _compare_runs, _trainer_run

    run = {"ga": 1, "max_grad_norm": 1e3, "optim": optim, "resume": True,
           "kinds": ["finite", "finite", "grad_inf", "finite", "finite", "finite"]}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sub = _trainer_run(run, torch.float16, str(tmp_path / "sub"))
        ref = _trainer_run(run, torch.float32, str(tmp_path / "ref"))
    _compare_runs(sub, ref, f"Trainer optim={optim}")
    assert sub[2]["stats"]["skipped_steps"] == ref[2]["stats"]["skipped_steps"] >= 1


def test_lomo_is_refused_by_name(tmp_path):
    """LOMO updates the weights inside the backward: no step to check or skip. Before: the Trainer died
    in `Tensor.backward()` on an unexpected `learning_rate` (torch's GradScaler path does the same)."""
    pytest.importorskip("lomo_optim")
    from test_master_differential_integrations import _trainer_run

    run = {"ga": 1, "max_grad_norm": 0.0, "optim": "lomo", "resume": False, "kinds": ["finite"] * 2}
    with pytest.raises(ValueError, match=r"Lomo \(optim='lomo'\) updates the weights inside the backward"):
        _trainer_run(run, torch.float16, str(tmp_path))


def test_a_closure_is_refused_by_name():
    """LBFGS re-runs forward and backward inside `step()`: refused before it runs, naming the optimizer,
    whether the closure is passed by keyword or by position. Before: a positional closure reached the
    optimizer and the scaler said `step() was called before scale()`."""
    model = Module(initial_values(), torch.float16)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(**CONFIG)

    def closure():
        opt.zero_grad()
        loss = scaler.scale(model(**_inputs(1))["loss"])
        loss.backward()
        return loss

    closure()
    for call in (lambda: scaler.step(opt, closure), lambda: scaler.step(opt, closure=closure)):
        with pytest.raises(RuntimeError, match=r"Closure use is not currently supported.*LBFGS"):
            call()
    off = DynamicLossScaler(mode="off")  # no scaling, but the model is held in FP16: refused too
    with pytest.raises(RuntimeError, match="LBFGS"):
        off.step(opt, closure)


def _inputs(seed: int, kind: str = "finite") -> dict:
    b = batch(seed, kind)
    return {"x": b["x"], "t1": b["t1"], "t2": b["t2"], "kind": kind}


# ---------------------------------------------------------------------- what reads .grad
def _pair(opt_kind: str = "adamw"):
    out = []
    for dtype in (torch.float16, torch.float32):
        model = Module(initial_values(), dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05) if opt_kind == "adamw" else torch.optim.SGD(
            model.parameters(), lr=0.05, momentum=0.9)  # fmt: skip
        out.append((model, opt, DynamicLossScaler(**CONFIG)))
    return out


def _weights_agree(sub_model, ref_model) -> bool:
    return all(
        torch.equal(a.detach(), b.detach().half())
        for a, b in zip(sub_model.parameters(), ref_model.parameters())
    )


def test_gradient_hooks_see_what_they_see_with_fp32_weights():
    """`register_hook` (the gradient on its way) and `register_post_accumulate_grad_hook` (the accumulated
    `.grad`) over accumulation and steps, including a hook that edits the gradient. Bug caught: a hook
    that sees a stand-in, or whose edit the masters never get."""
    logs = {}
    for model, opt, scaler in _pair():
        seen = []
        w1, w2 = model.w1, model.w2
        w1.register_hook(lambda g, seen=seen: seen.append(("hook", float(g.float().abs().sum()))))
        w2.register_hook(lambda g: g * 0.5)  # a hook that halves the gradient
        w2.register_post_accumulate_grad_hook(
            lambda p, seen=seen: seen.append(("acc", float(p.grad.float().norm())))
        )
        for step in range(4):
            for micro in range(2):
                scaler.scale(model(**_inputs(step * 2 + micro + 1))["loss"]).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        logs[model.w1.dtype] = (seen, [p.detach().half() for p in model.parameters()])
    (s, ws), (r, wr) = logs[torch.float16], logs[torch.float32]
    assert s == r and len(s) == 16
    assert all(torch.equal(a, b) for a, b in zip(ws, wr, strict=True))


def test_ema_of_a_model_held_in_fp16_averages_the_rounded_weights():
    """`AveragedModel` (EMA) of a model held in FP16 copies the FP16 module and averages its weights (the
    masters rounded), in FP16: within FP16 rounding of the FP32 reference's EMA, not equal to it. The
    remedy documented in docs/master-weights.md, an FP32 EMA (`.float()` with an `avg_fn` that casts,
    as torch's lerp takes one dtype), is bitwise the FP32 EMA of the rounded weights. Bug caught: the
    EMA copying a stand-in or a stale weight (it would drift from the reference by far more)."""
    (sub, sopt, ss), (ref, ropt, rs) = _pair()
    swa = torch.optim.swa_utils
    ema16 = swa.AveragedModel(sub, multi_avg_fn=swa.get_ema_multi_avg_fn(0.9))
    ema32 = swa.AveragedModel(sub, avg_fn=lambda avg, cur, n: avg.lerp(cur.float(), 0.1)).float()
    ema_ref = swa.AveragedModel(ref, multi_avg_fn=swa.get_ema_multi_avg_fn(0.9))
    by_hand = None  # AveragedModel's first update copies the weights
    for step in range(5):
        for model, opt, scaler in ((sub, sopt, ss), (ref, ropt, rs)):
            scaler.scale(model(**_inputs(step + 1))["loss"]).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        for ema, model in ((ema16, sub), (ema32, sub), (ema_ref, ref)):
            ema.update_parameters(model)
        now = [p.detach().half().float() for p in ref.parameters()]
        by_hand = now if by_hand is None else [e.lerp(w, 0.1) for e, w in zip(by_hand, now)]
    assert _weights_agree(sub, ref)
    assert all(p.dtype == torch.float16 for p in ema16.module.parameters())
    for a, b, c, d in zip(ema16.module.parameters(), ema32.module.parameters(), ema_ref.module.parameters(),
                          by_hand, strict=True):  # fmt: skip
        assert b.dtype == torch.float32 and torch.equal(b.detach(), d)
        bound = c.abs().max() * 2.0**-9  # a few FP16 roundings of the FP32 EMA
        assert 0 < (a.float() - c).abs().max() <= bound and (b - c).abs().max() <= bound


def test_tied_embeddings_get_one_master_and_train_as_the_fp32_reference():
    """An embedding tied to the output layer (one tensor, two uses; `tie_weights()`): one master, the two
    gradients summed, the same weights as FP32 weights. Bug caught: two masters for one tensor (the
    optimizer sees a parameter twice), the tied FP16 weight written from one of them only."""
    runs = {}
    for dtype in (torch.float16, torch.float32):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(5, 3).half().to(dtype)
        head = torch.nn.Linear(3, 5, bias=False).to(dtype)
        head.weight = emb.weight  # tied
        params = list({id(p): p for p in [*emb.parameters(), *head.parameters()]}.values())
        opt = torch.optim.AdamW(params, lr=0.05)
        scaler = DynamicLossScaler(**CONFIG)
        for step in range(4):
            ids = torch.randint(0, 5, (4,), generator=torch.Generator().manual_seed(step))
            target = torch.randint(-2, 3, (4, 5), generator=torch.Generator().manual_seed(100 + step)).half()
            w = emb.weight if dtype == torch.float16 else emb.weight.half()
            hidden = torch.nn.functional.embedding(ids, w)
            loss = ((hidden @ w.t()) * target).sum().float() * 2.0**-4
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        n_masters = len(scaler.master_weights.pairs(opt)) if dtype == torch.float16 else 1
        runs[dtype] = (emb.weight.detach().half().clone(), head.weight is emb.weight, n_masters)
    assert runs[torch.float16][1] and runs[torch.float16][2] == 1
    assert torch.equal(runs[torch.float16][0], runs[torch.float32][0])


class _CastLinear(torch.nn.Module):
    """A head whose weight is FP16 (the subject) or FP32 computing in FP16 (the reference)."""

    def __init__(self, w: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(w.half().to(dtype))

    def forward(self, x):
        return x @ self.weight.half().t()


class _Net(torch.nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.body = torch.nn.Linear(4, 6, bias=False).half()
        with torch.no_grad():
            self.body.weight.copy_(torch.randn(6, 4, generator=g))
        self.head = _CastLinear(torch.randn(3, 6, generator=g), dtype)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def test_peft_lora_with_modules_to_save_trains_and_saves_as_the_fp32_reference(tmp_path):
    """PEFT LoRA on an FP16 base with `modules_to_save`: the adapters are FP32 (PEFT's
    `autocast_adapter_dtype`), the saved module's trainable copy is FP16 and trains on a master. After
    steps with a skip, every trainable tensor and `save_pretrained`'s file equal the reference's (the
    copy in FP32 computing in FP16), and the frozen original is untouched. Bug caught: the copy's master
    made for the frozen original, the saved file holding a stale FP16 copy."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    out = {}
    for dtype in (torch.float16, torch.float32):
        torch.manual_seed(1)
        config = LoraConfig(r=2, target_modules=["body"], modules_to_save=["head"], init_lora_weights=False)
        model = get_peft_model(_Net(dtype), config)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
        scaler = DynamicLossScaler(**CONFIG)
        for step in range(5):
            g = torch.Generator().manual_seed(10 + step)
            x, t = torch.randn(5, 4, generator=g).half(), torch.randn(5, 3, generator=g).half()
            loss = ((model(x) - t).float() ** 2).mean() * (float("inf") if step == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        model.save_pretrained(tmp_path / str(dtype))
        saved = load_file(tmp_path / str(dtype) / "adapter_model.safetensors")
        trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        out[dtype] = (
            trained,
            saved,
            scaler.stats()["skipped_steps"],
            model.base_model.model.head.original_module,
        )
    (ts, ss, ks, orig), (tr, sr, kr, _) = out[torch.float16], out[torch.float32]
    assert ks == kr == 1
    assert ts["base_model.model.head.modules_to_save.default.weight"].dtype == torch.float16
    assert sorted(ts) == sorted(tr) and sorted(ss) == sorted(sr) and len(ss) == 3
    for got, want in ((ts, tr), (ss, sr)):
        assert all(torch.equal(got[n], want[n].to(got[n].dtype)) for n in got)
    assert torch.equal(orig.weight, _Net(torch.float16).head.weight)


def test_a_cast_mid_run_under_kahan_is_refused_by_name():
    """`master_weights="kahan"` keeps no FP32 master: a model cast mid-run cannot carry on from one, so
    the next step refuses, naming the parameter and the remedy. Bug caught: the FP16 arithmetic of the
    chunked update run into an FP32 or BF16 weight, silently."""
    model = Module(initial_values(), torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    scaler = DynamicLossScaler(**{**CONFIG, "master_weights": "kahan"})
    _steps(model, opt, scaler, [1])
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"master_weights='kahan' keeps no FP32 master.*torch.bfloat16"):
        _steps(model, opt, scaler, [2], cast=lambda p: p)


# ---------------------------------------------------------------------- checkpointing and compile
def _train_fp16(model_fn, steps: int = 4, wrap=lambda m: m) -> list[torch.Tensor]:
    model = Module(initial_values(), torch.float16)
    run = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    scaler = DynamicLossScaler(**CONFIG)
    for step in range(steps):
        kind = "grad_inf" if step == 1 else "finite"
        scaler.scale(model_fn(run, _inputs(step + 1, kind))).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert scaler.stats()["skipped_steps"] == 1
    return [p.detach().clone() for p in model.parameters()] + [
        m.detach().clone() for _, m in scaler.master_weights.pairs(opt)
    ]


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_run_without_it(reentrant):
    """`torch.utils.checkpoint` recomputes the forward during the backward: the FP16 gradients, the masters
    and the weights are bitwise those of the same run without it. Bug caught: the recomputed forward's
    gradient accumulating outside the masters' hooks (the re-entrant variant runs its own backward)."""
    from torch.utils.checkpoint import checkpoint

    plain = _train_fp16(lambda m, b: m(**b)["loss"])
    checked = _train_fp16(lambda m, b: checkpoint(lambda **kw: m(**kw)["loss"], use_reentrant=reentrant, **b)
                          if not reentrant else
                          checkpoint(lambda x: m(x=x, t1=b["t1"], t2=b["t2"], kind=b["kind"])["loss"],
                                     b["x"].requires_grad_(), use_reentrant=True))  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(plain, checked, strict=True))


def test_transformers_gradient_checkpointing_enable_gives_the_run_without_it():
    """`model.gradient_checkpointing_enable()` on a transformers model held in FP16, against the same
    model without it: the same FP16 weights and masters after steps with a skip in them."""
    from tiny_models import tiny_bert_classifier

    results = []
    for enable in (False, True):
        model = tiny_bert_classifier().half()
        if enable:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = 0.0
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = DynamicLossScaler(init_scale=2.0**8)
        for step in range(3):
            ids = torch.randint(
                0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(step)
            )
            loss = model(input_ids=ids, labels=torch.tensor([0, 1])).loss
            if step == 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert model.is_gradient_checkpointing == enable
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_torch_compile_of_the_model_gives_the_eager_run():
    """`torch.compile(model)` (eager kernels: `backend="aot_eager"`, so the arithmetic is eager's) trains
    the FP16 model on its masters exactly as eager does, through a skipped step. Bug caught: the
    compiled backward's gradients bypassing the FP16 parameters' accumulators (the masters' hooks)."""
    torch._dynamo.reset()
    eager = _train_fp16(lambda m, b: m(**b)["loss"])
    compiled = _train_fp16(lambda m, b: m(**{k: v for k, v in b.items() if k != "kind"}, kind=b["kind"])["loss"],
                           wrap=lambda m: torch.compile(m, backend="aot_eager"))  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))


# ---------------------------------------------------------------------- the lifecycle
def _steps(model, opt, scaler, seeds, cast=lambda p: p.half(), zero=True):
    for seed in seeds:
        w = {n: p if p.dtype in (torch.float16, torch.bfloat16) and cast is None else cast(p)
             for n, p in model.named_parameters()}  # fmt: skip
        b = _inputs(seed)
        x = b["x"].to(next(iter(w.values())).dtype)
        y1, y2 = x @ w["w1"].t() + w["b1"], x @ w["w2"].t()
        t1, t2 = b["t1"].to(x.dtype), b["t2"].to(x.dtype)
        loss = ((y1 * t1).sum().float() + (y2 * t2).sum().float()) * 2.0**-4
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if zero:
            opt.zero_grad()


def test_model_float_mid_run_continues_as_fp32_weights():
    """`model.float()` after some steps: the parameters are FP32 from then on and keep training from their
    masters' values, as the FP32 reference does. Bug caught: the FP32 parameter taken for a new weight
    (its master re-read from the FP16-rounded value, losing the bits below FP16)."""
    (sub, sopt, ss), (ref, ropt, rs) = _pair()
    for model, opt, scaler in ((sub, sopt, ss), (ref, ropt, rs)):
        _steps(model, opt, scaler, [1, 2, 3])
    sub.float()
    for model, opt, scaler in ((sub, sopt, ss), (ref, ropt, rs)):
        _steps(model, opt, scaler, [4, 5, 6])
    assert all(p.dtype == torch.float32 for p in sub.parameters())
    masters = [m for _, m in ss.master_weights.pairs(sopt)]
    for a, b, m in zip(sub.parameters(), ref.parameters(), masters, strict=True):
        assert torch.equal(m, b.detach()) and torch.equal(a.detach(), b.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kept_at_the_cast", [True, False], ids=["kept", "cleared"])
def test_a_cast_with_gradients_kept_across_steps_accumulates_as_the_fp32_reference(dtype, kept_at_the_cast):
    """No `zero_grad()` between steps (the gradient kept and added onto), with the model cast mid-run
    while an FP16 `.grad` stands for its master's. Torch gives a parameter whose dtype changed a new
    gradient accumulator. Bug caught: the marker kept in FP16 on the new parameter, and the next
    backward added into it in place, which crashed ("more than one element of the written-to tensor
    refers to a single memory location"), or skipped the master's gradient; with the gradient cleared
    at the cast, the new accumulator left unhooked until a later backward on top of a marker."""
    (sub, sopt, ss), (ref, ropt, rs) = _pair("sgd")
    for model, opt, scaler in ((sub, sopt, ss), (ref, ropt, rs)):
        _steps(model, opt, scaler, [1, 2], zero=not kept_at_the_cast)
    sub.to(dtype)
    _steps(sub, sopt, ss, [3, 4], cast=lambda p: p, zero=False)
    _steps(ref, ropt, rs, [3, 4], cast=lambda p: p.to(dtype), zero=False)
    masters = [m for _, m in ss.master_weights.pairs(sopt)]
    for a, b, m in zip(sub.parameters(), ref.parameters(), masters, strict=True):
        assert (
            a.dtype == dtype and torch.equal(m, b.detach()) and torch.equal(a.detach(), b.detach().to(dtype))
        )
        assert torch.equal(ss.master_weights.grad(sopt, a), b.grad)


def test_model_to_bfloat16_mid_run_keeps_its_fp32_masters():
    """`.to(torch.bfloat16)` after some steps: the masters carry on in FP32 and the weights are them rounded
    to BF16, which is what FP32 weights computing in BF16 give (the reference casts its FP32 weights to
    BF16 in the forward from then on). Bug caught: the BF16 weight taken for a new value (masters re-read
    from BF16, losing 16 bits), or still rounded to FP16."""
    (sub, sopt, ss), (ref, ropt, rs) = _pair()
    for model, opt, scaler in ((sub, sopt, ss), (ref, ropt, rs)):
        _steps(model, opt, scaler, [1, 2, 3])
    sub.to(torch.bfloat16)
    _steps(sub, sopt, ss, [4, 5, 6], cast=lambda p: p)
    _steps(ref, ropt, rs, [4, 5, 6], cast=lambda p: p.bfloat16())
    masters = [m for _, m in ss.master_weights.pairs(sopt)]
    for a, b, m in zip(sub.parameters(), ref.parameters(), masters, strict=True):
        assert a.dtype == torch.bfloat16
        assert torch.equal(m, b.detach()) and torch.equal(a.detach(), b.detach().bfloat16())


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_after_a_backward_is_a_model_of_its_own(how):
    """`copy.deepcopy(model)` / `torch.save(model)` after a backward and `unscale_` (the FP16 `.grad` are
    markers): the copy has the weights, no gradient (torch copies none for parameters, FP32 ones too),
    and trains on a new optimizer as an FP32 copy of the rounded weights does. Bug caught: a marker copied into the copy (reads
    a dead master), the copy's backward accumulating into the original's masters."""
    results = {}
    for model, opt, scaler in _pair():
        _steps(model, opt, scaler, [1])
        scaler.scale(model(**_inputs(2))["loss"]).backward()
        scaler.unscale_(opt)
        if how == "deepcopy":
            twin = copy.deepcopy(model)
        else:
            buf = io.BytesIO()
            torch.save(model, buf)
            buf.seek(0)
            twin = torch.load(buf, weights_only=False)
        grads = [p.grad for p in twin.parameters()]
        with torch.no_grad():  # the FP16 model's copy holds its FP16 weights: the FP32 copy, rounded
            for p in twin.parameters():
                p.copy_(p.half())
        topt = torch.optim.SGD(twin.parameters(), lr=0.1)
        tscaler = DynamicLossScaler(**CONFIG)
        _steps(twin, topt, tscaler, [3, 4])
        scaler.step(opt)
        scaler.update()
        results[model.w1.dtype] = (grads, [p.detach().half() for p in twin.parameters()],
                                   [p.detach().half() for p in model.parameters()])  # fmt: skip
    (g16, t16, m16), (g32, t32, m32) = results[torch.float16], results[torch.float32]
    assert g16 == g32 == [None, None, None]
    assert all(torch.equal(a, b) for a, b in zip(t16 + m16, t32 + m32, strict=True))


def test_an_optimizer_state_carried_into_an_fp32_model():
    """A second phase in FP32: the model `.float()`, a fresh optimizer over it, the first phase's
    `optimizer.state_dict()` loaded: the moments are the FP32 ones and training continues as the FP32
    reference's (whose weights were rounded to FP16 at the switch, as the FP16 checkpoint is)."""
    (sub, sopt, ss), (ref, ropt, rs) = _pair()
    for model, opt, scaler in ((sub, sopt, ss), (ref, ropt, rs)):
        _steps(model, opt, scaler, [1, 2, 3])
    state, ref_state = sopt.state_dict(), ropt.state_dict()
    phase2 = Module({n: p.detach().float() for n, p in sub.named_parameters()}, torch.float32)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.half().float())
    opt2 = torch.optim.AdamW(phase2.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt2.load_state_dict(state)
    ropt2 = torch.optim.AdamW(ref.parameters(), lr=0.05)
    ropt2.load_state_dict(ref_state)
    for k in ("exp_avg", "exp_avg_sq"):
        assert all(torch.equal(opt2.state[p][k], ropt2.state[q][k]) and opt2.state[p][k].dtype == torch.float32
                   for p, q in zip(phase2.parameters(), ref.parameters()))  # fmt: skip
    _steps(phase2, opt2, DynamicLossScaler(**CONFIG), [4, 5])
    _steps(ref, ropt2, DynamicLossScaler(**CONFIG), [4, 5])
    assert all(torch.equal(a, b) for a, b in zip(phase2.parameters(), ref.parameters()))


def test_schedule_free_eval_and_train_move_the_fp16_weights():
    """Schedule-free optimizers move the parameters in `eval()` / `train()` (the Trainer calls them around
    evaluation): the FP16 weights follow the masters there. Before: `eval()` moved the masters only, and
    evaluation ran on the training point's weights, silently."""
    schedulefree = pytest.importorskip("schedulefree")
    out = {}
    for dtype in (torch.float16, torch.float32):
        model = Module(initial_values(), dtype)
        opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=0.05)
        opt.train()
        _steps(model, opt, DynamicLossScaler(**CONFIG), [1, 2, 3])
        opt.eval()
        evaluated = [p.detach().half().clone() for p in model.parameters()]
        opt.train()
        out[dtype] = (evaluated, [p.detach().half().clone() for p in model.parameters()])
    for a, b in zip(
        out[torch.float16][0] + out[torch.float16][1], out[torch.float32][0] + out[torch.float32][1]
    ):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(*out[torch.float16]))  # eval() did move them
