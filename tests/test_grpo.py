"""GRPO in FP16 (`hf_lossscale.integrations.grpo`): a skipped step advances nothing, and the
sampler/trainer mismatch is measured while it trains, on a tiny GPT-2 built from a config."""

import json
import math

import pytest
import torch
from tiny_models import minilm_path
from transformers import Trainer, TrainerCallback

pytest.importorskip("trl")


@pytest.fixture(autouse=True)
def _quiet_trl(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in TRL


def grpo(
    tmp_path,
    callbacks=(),
    sampler="auto",
    steps=4,
    layers=1,
    width=32,
    prompt_tokens=8,
    dtype=None,
    attn=None,
    resume=None,
    **kw,
):
    from datasets import Dataset

    from hf_lossscale.integrations.grpo import FP16GRPOTrainer, KVCacheSampler
    from hf_lossscale.integrations.trl_trainers import FP16GRPOConfig
    from hf_lossscale.recipes.grpo import GRPOTaskArguments, build_model, corpus_text, prompts_from

    task = GRPOTaskArguments(model_name_or_path=None, scratch_layers=layers, scratch_width=width, dtype=dtype)
    out = tmp_path / "out"
    model, tokenizer = build_model(task, str(out))
    text = corpus_text(None)[:20000]
    settings = dict(output_dir=str(out), fp16=True, use_cpu=True, max_steps=steps, per_device_train_batch_size=8,
                    num_generations=4, max_completion_length=6, logging_steps=1, report_to=[], save_strategy="no",
                    disable_tqdm=True, learning_rate=1e-2, lr_scheduler_type="linear", loss_scale_init=1024.0,
                    beta=0.0)  # fmt: skip
    args = FP16GRPOConfig(**{**settings, **kw})
    trainer = FP16GRPOTrainer(model=model, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": prompts_from(text, tokenizer, prompt_tokens, 64)}),
                              # the completion's length in characters: varies within every group, so every
                              # step has a gradient (the vocabulary reward is often 0 for a whole group)
                              reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                              rollout_func=KVCacheSampler(sampler, attn),
                              callbacks=list(callbacks))  # fmt: skip
    for cb in callbacks:
        cb.trainer = trainer  # the watcher reads TRL's counter and the reference model
    trainer.train(resume_from_checkpoint=resume)
    events = [json.loads(line) for line in (out / "loss_scale_log.jsonl").read_text().splitlines()]
    return trainer, events


class InjectAndWatch(TrainerCallback):
    """Makes one gradient inf during the backward pass of optimizer step `bad` (1-based; a tensor
    hook, so the scaler's check sees it wherever it runs), and after every step records what could
    have advanced: policy and reference weights, the LR scheduler, TRL's micro-step counter."""

    def __init__(self, bad):
        self.bad, self.after, self.armed = bad, {}, False
        self.trainer = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        param = next(p for p in model.parameters() if p.requires_grad)
        param.register_hook(lambda g: torch.full_like(g, float("inf")) if self.armed else g)

    def on_step_begin(self, args, state, control, **kwargs):
        self.armed = state.global_step + 1 == self.bad

    def on_step_end(self, args, state, control, model=None, lr_scheduler=None, **kwargs):
        t = self.trainer
        self.after[state.global_step] = {
            "policy": [p.detach().clone() for p in model.parameters()],
            "ref": [p.detach().clone() for p in t.ref_model.parameters()]
            if t.ref_model is not None
            else None,
            "scheduler_steps": lr_scheduler.last_epoch,
            "lr": lr_scheduler.get_last_lr()[0],
            "trl_step": t._step,
        }


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_skipped_grpo_step_advances_nothing(tmp_path):
    """An overflow injected at step 2 of 4, with a reference model synced every step (alpha 0.5):
    step 2 leaves the policy, the reference model, the LR schedule and TRL's micro-step counter
    where step 1 left them, and says so in a `grpo_skip` event; step 3 moves all of them again.
    Bugs caught: TRL's own `SyncRefModelCallback` still mixing the (unchanged) policy into the
    reference on the skipped step, the scheduler stepped on a skip, the counter left advanced (the
    retry would take another slice of the generation batch), the sync never resuming."""
    watch = InjectAndWatch(bad=2)
    trainer, events = grpo(tmp_path, callbacks=[watch], beta=0.04, sync_ref_model=True, ref_model_sync_steps=1,
                           ref_model_mixup_alpha=0.5)  # fmt: skip
    a = watch.after
    assert trainer.loss_scaler.stats()["skipped_steps"] == 1 and trainer.applied_steps == 3
    assert _same(a[2]["policy"], a[1]["policy"]) and not _same(a[3]["policy"], a[2]["policy"])
    assert _same(a[2]["ref"], a[1]["ref"]) and not _same(a[3]["ref"], a[2]["ref"])
    assert a[2]["scheduler_steps"] == a[1]["scheduler_steps"] and a[2]["lr"] == a[1]["lr"]
    assert a[3]["scheduler_steps"] == a[1]["scheduler_steps"] + 1
    accumulation = trainer.current_gradient_accumulation_steps
    assert a[2]["trl_step"] == a[1]["trl_step"] and a[3]["trl_step"] == a[1]["trl_step"] + accumulation
    (skip,) = [e for e in events if e["event"] == "grpo_skip"]
    assert skip["step"] == 2 and skip["applied_steps"] == 1 and skip["ref_model_synced"] is False
    assert skip["scheduler_steps"] == a[1]["scheduler_steps"] and skip["trl_micro_step"] == a[1]["trl_step"]


def test_mismatch_is_measured_against_the_training_forward(tmp_path):
    """FP32 trainer, FP32 sampler: the sampler's log-probabilities (incremental decoding with a KV
    cache) and the training forward's agree to rounding (max |Δ| < 1e-4), so the comparison lines up
    token for token; a BF16 sampler against the same trainer moves them >= 10x further, is recorded
    in `run_start` and warned about. Bugs caught: an off-by-one between logits and tokens, the
    temperature applied on one side only, dropout in one path (each gives |Δ| ~ 0.1), the sampler
    not running in its own precision, or a mismatch of zero by construction (the trainer's figures
    compared with themselves)."""
    same, events_same = grpo(tmp_path / "same", sampler="fp32", fp16=False, steps=2)
    with pytest.warns(UserWarning, match="sampler runs in bf16 and the trainer in fp32"):
        other, events_other = grpo(tmp_path / "other", sampler="bf16", fp16=False, steps=2)
    rows_same = [e for e in events_same if e["event"] == "mismatch"]
    rows_other = [e for e in events_other if e["event"] == "mismatch"]
    assert [e["step"] for e in rows_same] == [1, 2] and [e["step"] for e in rows_other] == [1, 2]
    assert all(0 < e["max_abs_dlogp"] < 1e-4 for e in rows_same), rows_same
    assert all(o["mean_abs_dlogp"] > 10 * s["mean_abs_dlogp"] for o, s in zip(rows_other, rows_same))
    start = next(e for e in events_other if e["event"] == "run_start")
    assert start["rl"] == {
        "sampler_precision": "bf16",
        "trainer_precision": "fp32",
        "sampler": "KVCacheSampler",
        "sampler_attn_implementation": None,
    }
    logs = [e for e in other.state.log_history if "loss" in e]
    names = ["mismatch/p95_abs_dlogp", "mismatch/k3_kl", "mismatch/chi2_token", "mismatch/chi2_seq",
             "mismatch/log_ppl_diff", "mismatch/pearson_probs"]  # fmt: skip
    assert all(all(n in e for n in names) for e in logs)
    assert "mismatch/k3_kl_drift_per_100_steps" in logs[-1]


def test_fp16_grpo_measures_a_smaller_mismatch_than_bf16(tmp_path):
    """The paper's claim at its smallest: with the sampler in the trainer's precision, FP16 (with the
    scaler, emulated) leaves the two policies closer than BF16 does. Bug caught: the FP16 sampler
    running in FP32 or BF16, or the trainer's FP16 forward not emulated."""
    # the recipe's policy and lengths (2 layers, 128 wide, 16-token prompts and completions): with
    # one 32-wide layer and 6-token completions BF16's two paths round alike (|Δ| ~ 3e-7)
    shape = dict(steps=2, layers=2, width=128, prompt_tokens=16, max_completion_length=16)
    fp16, ev16 = grpo(tmp_path / "fp16", **shape)
    bf16, evbf = grpo(tmp_path / "bf16", fp16=False, bf16=True, **shape)
    m16 = [e["mean_abs_dlogp"] for e in ev16 if e["event"] == "mismatch"]
    mbf = [e["mean_abs_dlogp"] for e in evbf if e["event"] == "mismatch"]
    assert len(m16) == len(mbf) == 2 and all(b > 2 * f > 0 for b, f in zip(mbf, m16)), (m16, mbf)
    assert next(e for e in ev16 if e["event"] == "run_start")["rl"]["sampler_precision"] == "fp16"


def test_mismatch_stats():
    """Known deltas: the band is on the probability ratio exp(Δ) (0.9 and 1.1 are not symmetric in
    log space) and k3 is exp(Δ) - 1 - Δ. Bugs caught: the band applied to |Δ| (log 1.1 = 0.0953 and
    -log 0.9 = 0.1054), k3 with the wrong sign convention (negative), p95 taken over signed Δ."""
    from hf_lossscale.integrations.grpo import MISMATCH_KEYS, mismatch_stats

    delta = torch.tensor([0.0, 0.1, -0.1, 0.2, -0.5])
    sampler = torch.full_like(delta, -1.0)
    stats = dict(zip(MISMATCH_KEYS, mismatch_stats(sampler + delta, sampler).tolist()))
    assert stats["mean_abs_dlogp"] == pytest.approx(0.18) and stats["max_abs_dlogp"] == pytest.approx(0.5)
    assert stats["p95_abs_dlogp"] == pytest.approx(torch.quantile(delta.abs(), 0.95).item())
    assert stats["outside_band_frac"] == pytest.approx(
        3 / 5
    )  # +0.1 (ratio 1.105), 0.2 and -0.5; not -0.1 (0.905)
    k3 = sum(math.exp(d) - 1 - d for d in delta.tolist()) / 5
    assert stats["k3_kl"] == pytest.approx(k3) and k3 > 0
    assert all(math.isnan(v) for v in mismatch_stats(torch.zeros(0), torch.zeros(0)).tolist())


def test_mismatch_figures_rl_users_compare_against_a_hand_computation():
    """Two sequences, probabilities chosen so every figure is a fraction: trainer (0.5, 0.2 | 0.3),
    sampler (0.25, 0.4 | 0.6), a padded third slot masked out and a NaN sampler slot left out. Token
    ratios r = p_t / p_s are 2, 1/2, 1/2; sequence ratios R are 1 and 1/2. By hand:
    k3 = mean(r - 1 - log r) = [(1 - ln 2) + 2 (ln 2 - 1/2)] / 3 = ln 2 / 3; kl = mean(-log r) = ln 2 / 3;
    chi2_token = (4 + 1/4 + 1/4) / 3 - 1 = 1/2; chi2_seq = (1 + 1/4) / 2 - 1 = -3/8;
    log PPL_t - log PPL_s per sequence = -mean log r = 0 and ln 2: mean ln 2 / 2, max ln 2, min 0,
    |.| mean ln 2 / 2, PPL ratio mean (1 + 2) / 2 = 3/2; Pearson of (0.25, 0.4, 0.6) and (0.5, 0.2,
    0.3) = -57 / sqrt(9324) (centred sums: cov -57/1800, variances 222/3600 and 42/900).
    Bugs caught: Δ taken the other way (kl, log_ppl_diff flip sign), chi2 per token computed per
    sequence or without the - 1, R the mean rather than the product of ratios, padding or NaN tokens
    counted, the log PPL difference summed rather than averaged over a sequence's tokens."""
    from hf_lossscale.integrations.grpo import MISMATCH_KEYS, mismatch_stats

    log = math.log
    trainer = torch.tensor([[log(0.5), log(0.2), log(0.9)], [log(0.3), log(0.7), -5.0]])
    sampler = torch.tensor([[log(0.25), log(0.4), log(0.1)], [log(0.6), float("nan"), -1.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    got = dict(zip(MISMATCH_KEYS, mismatch_stats(trainer, sampler, mask).tolist()))
    ln2 = math.log(2)
    expected = {
        "mean_abs_dlogp": ln2, "max_abs_dlogp": ln2, "outside_band_frac": 1.0,
        "k3_kl": ln2 / 3, "kl": ln2 / 3, "chi2_token": 0.5, "chi2_seq": -3 / 8,
        "log_ppl_diff": ln2 / 2, "log_ppl_diff_max": ln2, "log_ppl_diff_min": 0.0,
        "log_ppl_abs_diff": ln2 / 2, "ppl_ratio": 1.5, "pearson_probs": -57 / math.sqrt(9324),
    }  # fmt: skip
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key


def test_mismatch_drift_is_a_slope_per_100_steps_and_warns_only_on_growth():
    """k3 KL 1, 2, 3, 4 at steps 0, 10, 20, 30 rises 0.1 a step: 10 per 100 steps, fitted 1 -> 4, growing
    (4x). A flat noisy series (0.9 / 1.1 alternating) and a series that falls are not growing, nor is a
    growing one before `min_steps`. Bugs caught: the slope per step (0.1) or per log, growth called on
    noise or on a falling mismatch, a verdict from too few steps."""
    from hf_lossscale.integrations.grpo import MismatchDrift

    drift = MismatchDrift(min_steps=4)
    for step, value in [(0, 1.0), (10, 2.0), (20, 3.0), (30, 4.0)]:
        drift.update(step, value)
    got = drift.summary()
    assert got["slope_per_100_steps"] == pytest.approx(10.0) and got["growing"]
    assert got["fitted_start"] == pytest.approx(1.0) and got["fitted_end"] == pytest.approx(4.0)
    early = MismatchDrift(min_steps=5)
    for step, value in [(0, 1.0), (10, 2.0), (20, 3.0), (30, 4.0)]:
        early.update(step, value)
    assert not early.summary()["growing"]
    flat, falling = MismatchDrift(min_steps=4), MismatchDrift(min_steps=4)
    for step in range(40):
        flat.update(step, 1.0 + (0.1 if step % 2 else -0.1))
        falling.update(step, 4.0 - 0.05 * step)
    assert not flat.summary()["growing"] and abs(flat.summary()["slope_per_100_steps"]) < 1
    assert not falling.summary()["growing"] and falling.summary()["slope_per_100_steps"] == pytest.approx(
        -5.0
    )
    with pytest.raises(ValueError, match="growth"):
        MismatchDrift(growth=1.0)
    # transformers' ExportableState: rebuilt from its state() as the Trainer does on resume
    drift.warned = True
    copy = MismatchDrift.from_state(json.loads(json.dumps(drift.state())))
    assert (copy.min_steps, copy.steps, copy.values, copy.warned) == (4, drift.steps, drift.values, True)
    assert copy.summary() == got
    # the shape every run has (all 9 runs of grpo_addition_cpu, FP32 included): k3 from ~0 at
    # initialization to rounding level as the policy sharpens; growing only where it ends >= min_value
    noise, real = MismatchDrift(min_steps=4), MismatchDrift(min_steps=4)
    for step in range(40):
        noise.update(step, 1e-11 + 2.5e-11 * step)
        real.update(step, 1e-6 + 2.5e-6 * step)
    assert noise.summary()["slope_per_100_steps"] > 0 and not noise.summary()["growing"]
    assert real.summary()["growing"] and real.summary()["fitted_end"] >= 1e-5


def test_grpo_trains_a_policy_held_in_fp16_on_masters(tmp_path):
    """The policy loaded in FP16 (`--dtype float16`, as transformers 5 loads a half checkpoint): the
    sampler generates with the FP16 weights, the optimizer steps FP32 masters, the weights stay FP16.
    Bug caught: "Attempting to unscale FP16 gradients" on TRL's GRPO path (no masters)."""
    trainer, events = grpo(tmp_path, steps=3, dtype="float16")
    pairs = trainer.loss_scaler.master_weights.pairs(trainer.optimizer)
    assert pairs and {str(p.dtype) for p in trainer.model.parameters()} == {"torch.float16"}
    assert all(torch.equal(h, m.half()) for h, m in pairs) and trainer.loss_scaler.stats()["total_steps"] == 3
    assert len([e for e in events if e["event"] == "mismatch"]) == 3


def test_a_sampler_with_its_own_attention_kernel(tmp_path):
    """`KVCacheSampler(attn_implementation="eager")` against the trainer's SDPA: in FP32 the two
    kernels agree to rounding; the trainer gets its own kernel back after each generation. Bugs
    caught: the eager kernel left in place for the training forward, or never switched on."""
    trainer, events = grpo(tmp_path, sampler="fp32", fp16=False, steps=2, attn="eager")
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert model.config._attn_implementation == "sdpa"
    start = next(e for e in events if e["event"] == "run_start")
    assert start["rl"]["sampler_attn_implementation"] == "eager"
    rows = [e for e in events if e["event"] == "mismatch"]
    assert len(rows) == 2 and all(0 < e["max_abs_dlogp"] < 1e-4 for e in rows), rows


def test_mismatch_reaches_tensorboard(tmp_path):
    """The `mismatch/...` figures go where the Trainer's logs go: read back from TensorBoard's event
    file, one value per step, equal to the event log's. Bug caught: figures kept in the event log
    only (or written under another step)."""
    pytest.importorskip("tensorboard")
    from test_report_to import read_events

    trainer, events = grpo(tmp_path, steps=2, report_to=["tensorboard"])
    tb = read_events(tmp_path / "out")
    written = {e.step: e.value for e in tb.Scalars("train/mismatch/p95_abs_dlogp")}
    logged = {e["step"]: e["p95_abs_dlogp"] for e in events if e["event"] == "mismatch"}
    assert sorted(written) == sorted(logged) == [1, 2]
    assert all(written[s] == pytest.approx(logged[s], rel=1e-6) for s in logged)


def test_applied_steps_only_skips_the_wrapped_callback_on_a_skipped_step(tmp_path):
    """A controller of one's own wrapped in `AppliedStepsOnly` runs on applied steps only: with the
    overflow at step 2 of 4 it sees steps 1, 3, 4. Bug caught: the wrapper forwarding every step (a
    KL controller would then adapt on a step that changed nothing)."""
    from hf_lossscale.integrations.grpo import AppliedStepsOnly

    class Controller(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    controller, watch = Controller(), InjectAndWatch(bad=2)
    wrapped = AppliedStepsOnly(controller, trainer=None)  # grpo() hands each callback the trainer once built
    trainer, _ = grpo(tmp_path, callbacks=[watch, wrapped])
    assert trainer.loss_scaler.stats()["skipped_steps"] == 1
    assert controller.steps == [1, 3, 4]


def test_a_resumed_run_keeps_counting_applied_steps(tmp_path):
    """Resumed from a checkpoint after a skipped step, the applied-step count (which schedules the
    reference sync) is the restored scaler's counters (`total_steps - skipped_steps`, the one source):
    4 steps with one skipped give 3 applied steps, as in the uninterrupted run. The k3 drift's series
    travels in the checkpoint (`ExportableState` in trainer_state.json) and comes back with and
    without transformers' `restore_callback_states_from_checkpoint`, so the resumed run's drift covers
    steps 1-4 as the uninterrupted run's does. Bugs caught: the count restarting at 0 on resume (the
    reference syncs fall on other steps), a count kept beside the scaler's that drifts from it, the
    drift restarting from the resume (its slope over the last steps only; a second warning)."""
    whole, _ = grpo(tmp_path / "whole", callbacks=[InjectAndWatch(bad=2)])
    cut, _ = grpo(tmp_path / "cut", callbacks=[InjectAndWatch(bad=2)], save_strategy="steps", save_steps=3)
    checkpoint = tmp_path / "cut" / "out" / "checkpoint-3"
    assert checkpoint.is_dir() and whole.applied_steps == cut.applied_steps == 3
    stats = whole.loss_scaler.stats()
    assert whole.applied_steps == stats["total_steps"] - stats["skipped_steps"]
    saved = json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]["MismatchDrift"]
    assert saved["attributes"]["steps"] == [1.0, 2.0, 3.0] and saved["args"]["min_steps"] == 20
    assert saved["attributes"]["values"] == cut.mismatch_drift.values[:3]
    assert whole.mismatch_drift.steps == [1.0, 2.0, 3.0, 4.0]
    for restore in (False, True):
        resumed, _ = grpo(tmp_path / "cut", callbacks=[InjectAndWatch(bad=99)], resume=str(checkpoint),
                          restore_callback_states_from_checkpoint=restore)  # fmt: skip
        assert resumed.state.global_step == 4 and resumed.applied_steps == 3
        drift = resumed.mismatch_drift
        assert drift.steps == [1.0, 2.0, 3.0, 4.0] and drift.values[:3] == saved["attributes"]["values"]
        assert sum(isinstance(cb, type(drift)) for cb in resumed.callback_handler.callbacks) == 1


def test_prompts_of_several_lengths_are_sampled_unpadded(tmp_path):
    """A batch whose prompts have two lengths in tokens, on a rotary decoder (a tiny Llama): the
    sampler generates each length without padding, the completions come back in the prompts' order,
    and against TRL's left-padded training forward (rotary positions: a shift changes nothing) the
    FP32 mismatch stays at rounding; a warning names what padding does to absolute positions. Bugs
    caught: the batch refused, completions handed back in another order (|Δ| ~ 1 then), pad tokens
    fed to the sampler."""
    from datasets import Dataset
    from test_trl import tiny_decoder
    from transformers import AutoTokenizer

    from hf_lossscale.integrations.grpo import FP16GRPOTrainer, KVCacheSampler
    from hf_lossscale.integrations.trl_trainers import FP16GRPOConfig

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    tokenizer.bos_token, tokenizer.eos_token = tokenizer.cls_token, tokenizer.sep_token
    prompts = ["the cat sat on the mat", "a dog ran far away into the green park today"] * 8
    args = FP16GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=2, per_device_train_batch_size=8,
                          num_generations=4, max_completion_length=6, logging_steps=1, report_to=[],
                          save_strategy="no", disable_tqdm=True, beta=0.0)  # fmt: skip
    trainer = FP16GRPOTrainer(model=tiny_decoder(tokenizer), args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": prompts}),
                              reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                              rollout_func=KVCacheSampler("fp32"))  # fmt: skip
    with pytest.warns(UserWarning, match="Prompts of 2 lengths"):
        trainer.train()
    events = [
        json.loads(line) for line in (tmp_path / "out" / "loss_scale_log.jsonl").read_text().splitlines()
    ]
    rows = [e for e in events if e["event"] == "mismatch"]
    assert len(rows) == 2 and all(e["max_abs_dlogp"] < 1e-4 for e in rows), rows


def sampler_trainer(tmp_path, model, tokenizer, **kw):
    """A `FP16GRPOTrainer` built (not trained) around `model`, for calling its sampler directly."""
    from datasets import Dataset

    from hf_lossscale.integrations.grpo import FP16GRPOTrainer, KVCacheSampler
    from hf_lossscale.integrations.trl_trainers import FP16GRPOConfig

    settings = dict(output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=1, per_device_train_batch_size=8,
                    num_generations=4, max_completion_length=8, report_to=[], save_strategy="no",
                    disable_tqdm=True, beta=0.0)  # fmt: skip
    return FP16GRPOTrainer(model=model, args=FP16GRPOConfig(**{**settings, **kw}), processing_class=tokenizer,
                           train_dataset=Dataset.from_dict({"prompt": ["a b"] * 8}),
                           reward_funcs=lambda completions, **_: [0.0] * len(completions),
                           rollout_func=KVCacheSampler("fp32"))  # fmt: skip


def tiny_policy(tmp_path, init=1.0, tied=True):
    """A 1-layer, 32-wide GPT-2 with MiniLM's vocabulary, its weights drawn with std `init` (1.0: a
    peaked policy, so that a repetition penalty moves its probabilities by ~0.3 nats, not ~1e-5), and
    eight 8-token prompts."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from hf_lossscale.recipes.grpo import corpus_text, prompts_from

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    tokenizer.eos_token, tokenizer.bos_token = tokenizer.sep_token, tokenizer.cls_token
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_layer=1, n_embd=32, n_head=2, n_positions=64,
                        initializer_range=init, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id,
                        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tied)  # fmt: skip
    model = GPT2LMHeadModel(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer, prompts_from(corpus_text(None)[:5000], tokenizer, 8, 8)


class RecordDraws:
    """Wraps `torch.multinomial` to keep each draw's probabilities and tokens: the distribution that
    `generate` actually sampled from, whatever processors built it."""

    def __init__(self, monkeypatch):
        self.draws, real = [], torch.multinomial

        def draw(probs, *args, **kwargs):
            out = real(probs, *args, **kwargs)
            self.draws.append((probs.detach().clone(), out.detach().clone()))
            return out

        monkeypatch.setattr(torch, "multinomial", draw)

    def logps(self):
        """(batch, steps): log p of each drawn token under the distribution it was drawn from."""
        return torch.stack([p.gather(-1, t.view(-1, 1)).squeeze(-1).log() for p, t in self.draws], dim=1)


def test_sampler_reports_the_log_probabilities_of_the_distribution_it_sampled(tmp_path, monkeypatch):
    """A model whose stored `generation_config` carries `repetition_penalty=1.3` (as Qwen2.5-Instruct
    ships 1.05): the sampler neutralises it as TRL's complete generation config does, so each reported
    log p equals the log of the probability the draw used, and equals the training forward's (FP32
    both, rounding only). With the penalty set in TRL's own config (TRL samples with it), the draws use
    it and the reported log p follows them, with a warning that the trainer scores the unprocessed
    distribution. Bugs caught: log p taken from the raw logits while `generate` applies the stored
    penalty (off by ~0.5 on repeated tokens), or TRL's own processors dropped."""
    model, tokenizer, prompts = tiny_policy(tmp_path)
    model.generation_config.repetition_penalty = 1.3
    trainer = sampler_trainer(tmp_path, model, tokenizer)
    record = RecordDraws(monkeypatch)
    torch.manual_seed(0)
    out = trainer.rollout_func(prompts, trainer)
    drawn = record.logps()
    assert model.generation_config.repetition_penalty == 1.3  # the model's own config is left as it was
    with torch.no_grad():  # the trainer's view: one full forward, log-softmax of logits / temperature
        ids = torch.tensor([p + c for p, c in zip(out["prompt_ids"], out["completion_ids"]) if len(c) > 1])
    checked = 0
    for row, (p, c, lp) in enumerate(zip(out["prompt_ids"], out["completion_ids"], out["logprobs"])):
        assert len(c) == len(lp) and torch.allclose(torch.tensor(lp), drawn[row, : len(c)], atol=1e-5), row
        with torch.no_grad():
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1].float() / trainer.temperature
        forward = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c).view(-1, 1)).squeeze(-1)
        assert torch.allclose(torch.tensor(lp), forward, atol=1e-4), (row, lp, forward.tolist())
        checked += len(c)
    assert checked >= 8 and ids.numel() > 0

    processed = sampler_trainer(tmp_path / "trl", model, tokenizer, repetition_penalty=1.3)
    record.draws.clear()
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="repetition_penalty"):
        out = processed.rollout_func(prompts, processed)
    drawn = record.logps()
    gaps = []
    for row, (p, c, lp) in enumerate(zip(out["prompt_ids"], out["completion_ids"], out["logprobs"])):
        assert torch.allclose(torch.tensor(lp), drawn[row, : len(c)], atol=1e-5), row
        with torch.no_grad():
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1].float()
        raw = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c).view(-1, 1)).squeeze(-1)
        gaps.append((torch.tensor(lp) - raw).abs().max().item())
    assert max(gaps) > 0.05  # the penalty was applied, and reported


def test_sampler_stops_at_every_eos_id_trl_uses(tmp_path):
    """The model's `generation_config.eos_token_id` is a list (Llama 3: `<|end_of_text|>` and
    `<|eot_id|>`), so TRL's `eos_token_ids` holds the tokenizer's id and another: a completion ends at
    the first of either, and its log-probabilities end with it. The second id is a token the policy
    draws first for some prompt with this seed, so it must cut that completion to one token. Bug
    caught: only `tokenizer.eos_token_id` stopping generation (the completion runs on past the other)."""
    model, tokenizer, prompts = tiny_policy(tmp_path)
    trainer = sampler_trainer(tmp_path, model, tokenizer)
    torch.manual_seed(0)
    first = trainer.rollout_func(prompts, trainer)
    other = next(c[0] for c in first["completion_ids"] if c[0] != tokenizer.eos_token_id and len(c) > 1)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, other]
    trainer = sampler_trainer(tmp_path / "list", model, tokenizer)
    assert set(trainer.eos_token_ids) == {tokenizer.eos_token_id, other}
    torch.manual_seed(0)
    out = trainer.rollout_func(prompts, trainer)
    stops = set(trainer.eos_token_ids)
    for c, lp in zip(out["completion_ids"], out["logprobs"]):
        assert len(c) == len(lp) and not stops & set(c[:-1]), c  # nothing after the first stop id
    cut = [c for c, f in zip(out["completion_ids"], first["completion_ids"]) if f[0] == other]
    assert cut and all(c == [other] for c in cut), cut


def test_mismatch_reads_the_log_probabilities_trl_already_holds_without_a_second_forward(tmp_path):
    """A rollout engine of its own (a frozen copy of the initial policy, as vLLM holds its own weights)
    hands TRL its log-probabilities; TRL keeps them as `sampling_per_token_logps`, and the trainer reads
    them against its training forward: the policy runs exactly one forward per micro-step (none
    extra), every step has a `mismatch` event, and at step 1 (same weights, FP32) the two agree to
    rounding. Bugs caught: a second forward to score the sampled tokens, the mismatch measured only
    with our own `KVCacheSampler`, or TRL's held log-probabilities misaligned with the tokens."""
    import copy

    from datasets import Dataset

    from hf_lossscale.integrations.grpo import FP16GRPOTrainer, KVCacheSampler
    from hf_lossscale.integrations.trl_trainers import FP16GRPOConfig

    model, tokenizer, prompts = tiny_policy(tmp_path, init=0.02)
    engine, sampler = copy.deepcopy(model), KVCacheSampler("fp32")

    def external_engine(batch, trainer):  # not a KVCacheSampler: the trainer knows nothing of it
        own = trainer.model
        trainer.model = engine
        try:
            return sampler(batch, trainer)
        finally:
            trainer.model = own

    args = FP16GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=3, per_device_train_batch_size=8,
                          num_generations=4, max_completion_length=6, logging_steps=1, report_to=[],
                          save_strategy="no", disable_tqdm=True, beta=0.0)  # fmt: skip
    trainer = FP16GRPOTrainer(model=model, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": prompts * 4}),
                              reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                              rollout_func=external_engine)  # fmt: skip
    forwards = []
    model.register_forward_pre_hook(lambda m, a: forwards.append(torch.is_grad_enabled()))
    trainer.train()
    events = [
        json.loads(line) for line in (tmp_path / "out" / "loss_scale_log.jsonl").read_text().splitlines()
    ]
    rows = [e for e in events if e["event"] == "mismatch"]
    assert forwards == [True] * 3 * trainer.current_gradient_accumulation_steps, forwards
    assert [e["step"] for e in rows] == [1, 2, 3] and rows[0]["max_abs_dlogp"] < 1e-4, rows
    assert next(e for e in events if e["event"] == "run_start")["rl"]["sampler"] is None


def test_async_grpo_is_refused_with_a_clear_error():
    """The pinned TRL ships AsyncGRPO (`trl.experimental.async_grpo`); under a loss scaler it is refused
    with the reason and what to use instead. Bug caught: a silent subclass whose vLLM weight sync
    advances on skipped steps."""
    from hf_lossscale.integrations.grpo import FP16AsyncGRPOTrainer, async_grpo_available

    assert async_grpo_available()
    with pytest.raises(NotImplementedError, match="ships it .*weight sync.*Use FP16GRPOTrainer"):
        FP16AsyncGRPOTrainer(model=None)


def test_loss_scale_mixin_refuses_trls_async_grpo_at_class_creation():
    """`class T(LossScaleMixin, AsyncGRPOTrainer)` (either order, or through a subclass of TRL's) fails
    when the class is made, naming TRL's trainer and the reason `FP16AsyncGRPOTrainer` gives. Bug
    caught: a user's own mix training with the scaler while its weight pushes count skipped steps."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from hf_lossscale import LossScaleMixin

    class TheirAsync(AsyncGRPOTrainer):
        pass

    for bases in [
        (LossScaleMixin, AsyncGRPOTrainer),
        (AsyncGRPOTrainer, LossScaleMixin),
        (LossScaleMixin, TheirAsync),
    ]:
        with pytest.raises(TypeError, match=r"class T mixes LossScaleMixin with TRL's AsyncGRPOTrainer "
                           r"\(trl\.experimental\.async_grpo.*weight sync.*Use FP16GRPOTrainer"):  # fmt: skip
            type("T", bases, {})

    class Fine(LossScaleMixin, Trainer):  # any other Trainer subclass is accepted
        pass


def test_a_skipped_step_rolls_back_trls_adaptive_entropy_controller(tmp_path):
    """TRL 1.16's adaptive entropy control (`use_adaptive_entropy`) moves its coefficient inside the
    loss at the step boundary, before the scaler decides. With the entropy always under target (+0.01
    a step) and an overflow at step 2 of 4, the coefficient after steps 1-4 is 0.01, 0.01, 0.02, 0.03
    and the `grpo_skip` event says it was restored. Bug caught: the controller advancing on a step
    that changed no weight (0.02 after the skip)."""
    from hf_lossscale.integrations.compat import TRL_INSTANCE_INTERNALS

    class Coef(TrainerCallback):
        def __init__(self):
            self.coefs, self.trainer = {}, None

        def on_step_end(self, args, state, control, **kwargs):
            self.coefs[state.global_step] = self.trainer.entropy_coef

    coef = Coef()
    trainer, events = grpo(tmp_path, callbacks=[InjectAndWatch(bad=2), coef], use_adaptive_entropy=True,
                           entropy_coef=0.0, entropy_coef_delta=0.01, entropy_target=100.0)  # fmt: skip
    for _, cls, attr in TRL_INSTANCE_INTERNALS:
        assert hasattr(trainer, attr), (cls, attr)
    assert trainer.loss_scaler.stats()["skipped_steps"] == 1
    assert [round(coef.coefs[s], 6) for s in (1, 2, 3, 4)] == [0.01, 0.01, 0.02, 0.03], coef.coefs
    (skip,) = [e for e in events if e["event"] == "grpo_skip"]
    assert skip["entropy_coef_restored"] is True


def test_addition_reward_is_exact_and_graded_by_digits_of_error():
    """`123 + 456 = 579`, answers of up to 4 digits: the exact sum (with or without its leading zero)
    scores 1; off by 1 scores 1 - log10(2)/4, off by 9 exactly 3/4, off by 99 exactly 1/2, off by 999
    exactly 1/4; anything but 1-4 digit tokens scores 0; the accuracy reward is 1 only for the exact
    sum. The held-out problems share no prompt with the training ones and every prompt has one length
    in tokens. Bugs caught: the answer read with the prompt's digit count (off by one width), a
    non-numeric or over-long completion rewarded, held-out problems seen in training."""
    from hf_lossscale.recipes.grpo import AdditionExact, AdditionReward, addition_problems, digit_tokenizer

    prompt = "1 2 3 + 4 5 6 ="
    completions = ["0 5 7 9", "5 7 9", "5 8 0", "5 8 8", "6 7 8", "1 5 7 8", "5 7 + 9", "0 5 7 9 0", ""]
    got = AdditionReward()(completions, prompts=[prompt] * len(completions))
    expected = [1.0, 1.0, 1 - math.log10(2) / 4, 3 / 4, 1 / 2, 1 / 4, 0.0, 0.0, 0.0]
    assert got == pytest.approx(expected)
    assert AdditionExact()(completions, prompts=[prompt] * len(completions)) == [1.0, 1.0] + [0.0] * 7
    assert AdditionReward()(["1 0 0 0"], prompts=["9 9 9 + 0 0 1 ="]) == [1.0]
    train = addition_problems(3, 200, seed=1)
    held = addition_problems(3, 50, seed=2, exclude=set(train))
    assert len(set(train)) == 200 and len(held) == 50 and not set(train) & set(held)
    tokenizer = digit_tokenizer()
    lengths = {len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in train + held}
    assert lengths == {8} and tokenizer.decode(tokenizer("0 5 7 9")["input_ids"]).split() == list("0579")


def test_the_recipe_trains_the_addition_task(tmp_path, monkeypatch):
    """`recipes/grpo.py --task addition` for 3 FP16 steps: digit-vocabulary policy, per-step rewards in
    [0, 1] and the mismatch figures in the event log, held-out evaluation. Bug caught: the task not
    wired (the vocabulary reward or MiniLM's tokenizer used), prompts of several lengths."""
    from hf_lossscale.recipes.grpo import main

    out = tmp_path / "out"
    main(["--task", "addition", "--do_train", "--do_eval", "--output_dir", str(out), "--use_cpu", "true", "--fp16",
          "--max_steps", "3", "--per_device_train_batch_size", "16", "--num_generations", "8",
          "--max_completion_length", "4", "--scratch_width", "32", "--scratch_layers", "1", "--logging_steps", "1",
          "--max_eval_prompts", "8", "--per_device_eval_batch_size", "16", "--beta", "0.0",
          "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"])  # fmt: skip
    events = [json.loads(line) for line in (out / "loss_scale_log.jsonl").read_text().splitlines()]
    logs = [e for e in events if e["event"] == "log" and "reward" in e and "loss" in e]
    assert len(logs) == 3 and all(0.0 <= e["reward"] <= 1.0 for e in logs)
    assert all("rewards/addition_reward/mean" in e and "rewards/addition_exact/mean" in e for e in logs)
    assert [e["step"] for e in events if e["event"] == "mismatch"] == [1, 2, 3]
    assert any("eval_reward" in e for e in events if e["event"] == "log")
    assert (out / "initial-model" / "tokenizer.json").is_file()


def test_the_sampler_keeps_trls_fp32_lm_head_under_autocast(tmp_path):
    """`cast_lm_head_to_fp32=True` with a BF16 trainer: TRL computes the training log-probabilities in
    FP32 (its fused head runs outside autocast) and casts the head's weights and inputs to FP32, but
    under autocast `F.linear` runs in BF16 again, so the sampler's head must run with autocast off:
    its logits come out FP32 while sampling, and the head's forward is TRL's again afterwards. Bug
    caught: the sampler's head in BF16 against the trainer's FP32 head (the mismatch then measures the
    cast: BF16's mean |Δ log p| 2.8x the uncast run's in benchmarks/grpo_lm_head_fp32.py)."""
    model, tokenizer, prompts = tiny_policy(tmp_path, init=0.02, tied=False)
    trainer = sampler_trainer(tmp_path, model, tokenizer, bf16=True, cast_lm_head_to_fp32=True)
    trainer.rollout_func = type(trainer.rollout_func)("bf16")
    head = trainer.accelerator.unwrap_model(trainer.model).lm_head
    trl_forward = head.forward
    dtypes = []
    head.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    trainer.rollout_func(prompts, trainer)
    assert dtypes and set(dtypes) == {torch.float32}, dtypes
    assert head.forward is trl_forward
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what the sampler would get without the guard
        assert head(torch.randn(2, head.in_features)).dtype == torch.bfloat16


def test_the_sampler_computes_fp16_as_the_trainer_does_on_the_cpu(tmp_path):
    """`KVCacheSampler("fp16")` on a CPU takes the trainer's own FP16 compute (the context
    `install_loss_scaler` set up): the emulation by default, real CPU autocast with
    `loss_scale_fp16_on_cpu="native"`. Bug caught: the sampler emulating while the trainer ran
    native CPU FP16 (or the reverse), so that mismatch/ measured the two FP16s apart; it happened
    when the install's context moved to `accelerator.hf_lossscale` and the sampler still looked for
    the old private attribute."""
    from hf_lossscale.fp16.emulation import fp16_emulation
    from hf_lossscale.integrations.grpo import KVCacheSampler

    emulated, _ = grpo(tmp_path / "emulated", steps=1)
    native, _ = grpo(tmp_path / "native", steps=1, loss_scale_fp16_on_cpu="native")
    assert type(KVCacheSampler("fp16").context(emulated)) is type(fp16_emulation("cuda"))
    context = KVCacheSampler("fp16").context(native)
    assert isinstance(context, torch.autocast) and (context.device, context.fast_dtype) == (
        "cpu",
        torch.float16,
    )
