import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_bert_classifier, tiny_classification_dataset
from transformers import HfArgumentParser, TrainerCallback, TrainingArguments

from hf_lossscale import LossScaleConfig, LossScaleMixin, LossScaleTrainer, LossScaleTrainingArguments


class Recorder(TrainerCallback):
    """Weights and LR after every optimizer step."""

    def __init__(self):
        self.lrs, self.weights = [], []

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
        self.lrs.append(lr_scheduler.get_last_lr()[0])
        self.weights.append(model.classifier.weight.detach().clone())


class InjectingTrainer(LossScaleTrainer):
    """A user-style subclass overriding compute_loss: makes the loss non-finite at chosen steps."""

    bad_steps = ()

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        if self.state.global_step in self.bad_steps and not return_outputs:  # training steps only
            loss = loss * float("inf")
        return loss


def make_args(tmp_path, **kw):
    defaults = dict(
        output_dir=str(tmp_path / "out"),
        fp16=True,
        per_device_train_batch_size=8,
        max_steps=12,
        logging_steps=2,
        report_to=[],
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        loss_scale_init=2.0**10,
        loss_scale_growth_interval=3,
    )
    defaults.update(kw)
    return LossScaleTrainingArguments(**defaults)


def train(tmp_path, bad_steps=(), resume=None, **kw):
    rec = Recorder()
    trainer = InjectingTrainer(
        model=tiny_bert_classifier(),
        args=make_args(tmp_path, **kw),
        train_dataset=tiny_classification_dataset(),
        callbacks=[rec],
    )
    trainer.bad_steps = bad_steps
    dtypes = []
    trainer.model.bert.encoder.layer[0].attention.self.query.register_forward_hook(
        lambda m, i, o: dtypes.append("emulated" if getattr(o, "_hf_fp16", False) else o.dtype)
    )
    result = trainer.train(resume_from_checkpoint=resume)
    return trainer, rec, result, dtypes


@pytest.mark.parametrize(
    ("optim", "fp16_on_cpu"), [("adamw_torch", "native"), ("adamw_torch_fused", "emulate")]
)
def test_cpu_fp16_training_with_injected_overflow(tmp_path, optim, fp16_on_cpu):
    trainer, rec, result, dtypes = train(
        tmp_path, bad_steps=(4,), optim=optim, loss_scale_fp16_on_cpu=fp16_on_cpu
    )
    # really FP16 ops on the CPU (native), or FP32 ops rounded as FP16 (emulated)
    assert set(dtypes) == {torch.float16 if fp16_on_cpu == "native" else "emulated"}
    # step index 4 (the 5th optimizer step) was skipped: weights and LR unchanged
    assert torch.equal(rec.weights[4], rec.weights[3])
    assert rec.lrs[4] == rec.lrs[3]
    assert all(not torch.equal(rec.weights[i], rec.weights[i - 1]) for i in range(1, 12) if i != 4)
    assert all(rec.lrs[i] < rec.lrs[i - 1] for i in range(1, 12) if i != 4)
    stats = trainer.loss_scaler.stats()
    assert (stats["total_steps"], stats["skipped_steps"]) == (12, 1)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert {"loss_scale", "skipped_steps", "overflow_rate", "fp16_emulated"} <= set(logs[0])
    assert logs[0]["fp16_emulated"] == (1.0 if fp16_on_cpu == "emulate" else 0.0)
    by_step = {entry["step"]: entry for entry in logs}
    assert by_step[4]["skipped_steps"] == 0 and by_step[6]["skipped_steps"] == 1
    assert by_step[6]["overflow_rate"] == 0.5 and by_step[8]["overflow_rate"] == 0.0
    losses = [entry["loss"] for entry in logs]
    assert losses[-1] < losses[0]


def test_resume_continues_exact_trajectory(tmp_path):
    kw = dict(save_strategy="steps", save_steps=6, optim="adamw_torch_fused")
    full, rec_full, *_ = train(tmp_path / "a", bad_steps=(3, 8), **kw)
    ckpt = tmp_path / "a" / "out" / "checkpoint-6"
    assert (ckpt / "scaler.pt").is_file()
    resumed, rec_resumed, *_ = train(tmp_path / "a", bad_steps=(3, 8), resume=str(ckpt), **kw)
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)

    def scales(t):
        return [
            (e["step"], e["loss_scale"], e["skipped_steps"], e["overflow_rate"])
            for e in t.state.log_history
            if "loss" in e
        ]

    assert scales(full) == scales(resumed)  # the resumed history holds the checkpoint's first part
    assert [s[0] for s in scales(full)] == [2, 4, 6, 8, 10, 12]
    assert [s[2] for s in scales(full)] == [0, 1, 1, 1, 2, 2]  # global_step 3 and 8 overflowed
    assert full.loss_scaler.stats() == resumed.loss_scaler.stats()


def test_resume_from_torch_grad_scaler_checkpoint(tmp_path):
    kw = dict(save_strategy="steps", save_steps=6, max_steps=6)
    train(tmp_path, **kw)
    ckpt = tmp_path / "out" / "checkpoint-6"
    gs = torch.amp.GradScaler("cpu", init_scale=512.0)
    torch.save(gs.state_dict(), ckpt / "scaler.pt")
    trainer, *_ = train(
        tmp_path, resume=str(ckpt), max_steps=7, loss_scale_growth_interval=100, save_strategy="no"
    )
    assert trainer.loss_scaler.get_scale() == 512.0


def test_missing_or_corrupt_scaler_state_is_refused(tmp_path):
    kw = dict(save_strategy="steps", save_steps=6, max_steps=6)
    train(tmp_path, **kw)
    ckpt = tmp_path / "out" / "checkpoint-6"
    (ckpt / "scaler.pt").write_bytes(b"\x80\x02truncated")
    with pytest.raises(
        RuntimeError, match=r"Cannot read the loss-scaler state .*scaler\.pt.*loss_scale_fresh_on_resume"
    ):
        train(tmp_path, resume=str(ckpt), max_steps=8, save_strategy="no")
    (ckpt / "scaler.pt").write_bytes(b"")  # an empty file: torch raises EOFError with no message
    with pytest.raises(RuntimeError, match=r"scaler\.pt: EOFError \(the file is 0 bytes\)"):
        train(tmp_path, resume=str(ckpt), max_steps=8, save_strategy="no")
    (ckpt / "scaler.pt").unlink()
    with pytest.raises(RuntimeError, match=r"holds no loss-scaler state.*silently reset"):
        train(tmp_path, resume=str(ckpt), max_steps=8, save_strategy="no")
    with pytest.warns(UserWarning, match="Starting a fresh loss scaler"):
        trainer, *_ = train(
            tmp_path, resume=str(ckpt), max_steps=8, save_strategy="no", loss_scale_fresh_on_resume=True
        )
    assert trainer.loss_scaler.stats()["total_steps"] == 2


def test_explicit_config_wins_and_plain_training_arguments_work(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_LOSSSCALE_HYSTERESIS", "3")
    args = TrainingArguments(
        str(tmp_path), fp16=True, report_to=[], max_steps=2, per_device_train_batch_size=8
    )
    trainer = LossScaleTrainer(
        model=tiny_bert_classifier(), args=args, train_dataset=tiny_classification_dataset()
    )
    assert trainer.loss_scaler.config.hysteresis == 3  # environment
    largs = make_args(tmp_path, loss_scale_hysteresis=2)
    trainer = LossScaleTrainer(
        model=tiny_bert_classifier(), args=largs, train_dataset=tiny_classification_dataset()
    )
    assert trainer.loss_scaler.config.hysteresis == 2  # argument beats environment
    trainer = LossScaleTrainer(
        model=tiny_bert_classifier(),
        args=largs,
        train_dataset=tiny_classification_dataset(),
        loss_scale_config=LossScaleConfig(hysteresis=5),
    )
    assert trainer.loss_scaler.config.hysteresis == 5  # explicit config beats all


def test_mixin_with_seq2seq_trainer(tmp_path):
    from datasets import Dataset
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, T5Config, T5ForConditionalGeneration

    class MySeq2SeqTrainer(LossScaleMixin, Seq2SeqTrainer):
        pass

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(
        T5Config(
            vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0
        )
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (32, 8), generator=g)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.flip(1).tolist()})
    args = Seq2SeqTrainingArguments(
        str(tmp_path), fp16=True, report_to=[], max_steps=6, logging_steps=3, per_device_train_batch_size=8
    )
    trainer = MySeq2SeqTrainer(
        model=model, args=args, train_dataset=ds, loss_scale_config=LossScaleConfig(init_scale=256.0)
    )
    trainer.train()
    assert trainer.loss_scaler.stats()["total_steps"] == 6
    # training logs carry the scaler's figures; the end-of-training summary does not (issue 48)
    assert all(("loss_scale" in e) == ("loss" in e) for e in trainer.state.log_history)
    assert sum("loss" in e for e in trainer.state.log_history) == 2


def test_hf_argument_parser_flags_and_files(tmp_path):
    parser = HfArgumentParser(LossScaleTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir", str(tmp_path), "--fp16", "--report_to", "none",
            "--loss_scale_mode", "static", "--loss_scale_init", "4096", "--loss_scale_min", "4",
            "--loss_scale_hysteresis", "2", "--loss_scale_consecutive_hysteresis", "true",
            "--loss_scale_max_consecutive_skips", "0",
        ]
    )  # fmt: skip
    assert args.loss_scale_overrides() == {
        "mode": "static",
        "init_scale": 4096.0,
        "min_scale": 4.0,
        "hysteresis": 2,
        "consecutive_hysteresis": True,
        "max_consecutive_skips": None,
    }
    path = tmp_path / "args.yaml"
    path.write_text(f"output_dir: {tmp_path}\nfp16: true\nreport_to: none\nloss_scale_max: 65536\n")
    (args,) = parser.parse_yaml_file(str(path))
    assert args.loss_scale_overrides() == {"max_scale": 65536}
    with pytest.raises(ValueError, match=r"backoff_factor=2\.0.*set by --loss_scale_backoff_factor\)"):
        parser.parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--fp16", "--loss_scale_backoff_factor", "2"]
        )


def test_settings_without_fp16_warn(tmp_path, monkeypatch):
    with pytest.warns(UserWarning, match=r"\['loss_scale_min'\] are set but FP16 is off"):
        LossScaleTrainingArguments(str(tmp_path), report_to=[], loss_scale_min=2.0)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        args = LossScaleTrainingArguments(str(tmp_path), report_to=[], loss_scale_min=2.0)
    assert args.fp16_effective


@pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate CLI not on PATH")
def test_accelerate_launch_configured_through_environment(tmp_path):
    out = tmp_path / "result.json"
    env = {
        **os.environ,
        "HF_LOSSSCALE_INIT_SCALE": "256",
        "HF_LOSSSCALE_HYSTERESIS": "2",
        "HF_LOSSSCALE_MAX_CONSECUTIVE_SKIPS": "none",
        "HF_LOSSSCALE_FP16_ON_CPU": "native",
    }
    script = Path(__file__).parent / "scripts" / "accelerate_train.py"
    # this interpreter's accelerate (a bare `accelerate` on PATH may belong to another environment)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", "fp16", "--dynamo_backend", "no", str(script), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    result = json.loads(out.read_text())
    assert result["mixed_precision"] == "fp16"
    assert result["config"]["init_scale"] == 256.0 and result["config"]["hysteresis"] == 2
    assert result["config"]["max_consecutive_skips"] is None
    assert result["dtypes"] == ["torch.float16"]
    assert result["stats"]["total_steps"] == 20 and result["stats"]["skipped_steps"] == 1
    assert result["stats"]["loss_scale"] == 256.0  # hysteresis 2: one overflow does not back off
    assert result["last_loss"] < result["first_loss"]


def test_event_log_and_flushed_probe_leave_training_unchanged(tmp_path):
    from hf_lossscale.core.events import read_run_events

    _, plain, _, _ = train(tmp_path / "a", gradient_accumulation_steps=2, loss_scale_event_log=False)
    _, probed, _, _ = train(tmp_path / "b", gradient_accumulation_steps=2, loss_scale_measure_flushed=True)
    assert not (tmp_path / "a" / "out" / "loss_scale_log.jsonl").exists()
    # The probe runs in eval mode on a copy of the first batch: the trajectory is bitwise the same.
    assert all(torch.equal(x, y) for x, y in zip(plain.weights, probed.weights, strict=True))
    run = read_run_events(tmp_path / "b" / "out" / "loss_scale_log.jsonl")
    kinds = [e["event"] for e in run]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end" and kinds.count("flushed_probe") == 2
    assert run[0]["fp16"] == "emulated" and run[0]["gradient_accumulation_steps"] == 2
    probe = next(e for e in run if e["event"] == "flushed_probe")
    assert probe["scale"] == 2.0**10 and probe["loss_divisor"] == 2 and 0.0 <= probe["flushed_fraction"] < 1.0
    assert run[-1]["total_steps"] == 12 and len([e for e in run if "loss" in e]) == 6  # logging_steps=2


def test_event_log_records_a_collapse_and_appends_on_rerun(tmp_path):
    from hf_lossscale import LossScaleCollapseError
    from hf_lossscale.core.events import read_events, read_run_events

    with pytest.raises(LossScaleCollapseError):
        train(tmp_path, bad_steps=range(100), loss_scale_max_consecutive_skips=3)
    path = tmp_path / "out" / "loss_scale_log.jsonl"
    error = read_run_events(path)[-1]
    assert (
        error["event"] == "error" and error["collapse"] is True and error["type"] == "LossScaleCollapseError"
    )
    train(tmp_path)  # a second run into the same folder appends; the reader takes the latest run
    assert sum(e["event"] == "run_start" for e in read_events(path)) == 2
    assert read_run_events(path)[-1]["event"] == "run_end"


def test_accumulated_loss_is_averaged_for_models_that_ignore_num_items(tmp_path):
    """transformers 5.24's BertForMaskedLM takes **kwargs but computes a plain mean loss: left to the
    Trainer, its gradients under accumulation would be the sum of the micro-batches'. The mixin
    makes the Trainer divide instead; a model that uses num_items_in_batch is left alone."""
    from transformers import BertConfig, BertForMaskedLM, BertLMHeadModel

    from hf_lossscale.integrations.loss_normalisation import loss_ignores_num_items

    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, is_decoder=True, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)  # fmt: skip
    mlm, clm = (
        BertForMaskedLM(config.__class__(**{**config.to_dict(), "is_decoder": False})),
        BertLMHeadModel(config),
    )
    assert loss_ignores_num_items(mlm) and not loss_ignores_num_items(clm)

    def trainer(model, accumulation, **kw):
        args = TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=accumulation,
                                 report_to=[], use_cpu=True)  # fmt: skip
        return LossScaleTrainer(model=model, args=args, **kw)

    assert trainer(mlm, 4).model_accepts_loss_kwargs is False
    assert trainer(clm, 4).model_accepts_loss_kwargs is True
    assert trainer(mlm, 1).model_accepts_loss_kwargs is True  # nothing to divide
    own = trainer(mlm, 4, compute_loss_func=lambda outputs, labels, num_items_in_batch: outputs.loss)
    assert own.model_accepts_loss_kwargs is True  # the user's loss function decides

    # The gradient of one accumulated step equals that of the whole batch at once.
    torch.manual_seed(0)
    ids = torch.randint(5, 64, (4, 8))
    batch = {"input_ids": ids, "labels": ids.clone()}
    reference = BertForMaskedLM(mlm.config)
    reference.load_state_dict(mlm.state_dict())
    reference(**batch).loss.backward()
    t = trainer(mlm, 4)
    t.current_gradient_accumulation_steps = 4  # as the training loop sets it
    model = t.model
    model.zero_grad()
    for i in range(4):
        micro = {k: v[i : i + 1] for k, v in batch.items()}
        t.training_step(model, micro, num_items_in_batch=torch.tensor(32))
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_accumulated_loss_fix_looks_through_peft_and_can_be_turned_off(tmp_path):
    """The fix decides on the model under the PEFT wrapper, as the Trainer does. Bugs caught: reading
    the wrapper's `forward` (PeftModel's source names neither `num_items_in_batch` nor
    `loss_function`, so a model that does normalise by it, BertLMHeadModel, would be "fixed" and its
    gradients divided twice); the flag ignored; the fix acting without a word in the event log."""
    peft = pytest.importorskip("peft")
    from transformers import BertConfig, BertForMaskedLM, BertLMHeadModel

    from hf_lossscale.core.events import read_run_events

    config = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip

    def lora(model):
        torch.manual_seed(0)
        return peft.get_peft_model(
            model, peft.LoraConfig(r=4, target_modules=["query", "value"], init_lora_weights=False)
        )

    def trainer(model, fix=True, **kw):
        args = LossScaleTrainingArguments(output_dir=str(tmp_path / "out"), gradient_accumulation_steps=4, report_to=[],
                                          use_cpu=True, loss_scale_fix_accumulated_loss=fix, **kw)  # fmt: skip
        return LossScaleTrainer(model=model, args=args)

    torch.manual_seed(0)
    mlm = BertForMaskedLM(BertConfig(**config))
    clm = BertLMHeadModel(BertConfig(**config, is_decoder=True))
    assert trainer(lora(clm)).model_accepts_loss_kwargs is True  # it uses num_items_in_batch: left alone
    assert trainer(lora(mlm)).model_accepts_loss_kwargs is False  # the fix, seen through the wrapper
    assert trainer(lora(mlm), fix=False).model_accepts_loss_kwargs is True  # the Trainer's own behaviour

    # One accumulated step's LoRA gradient: the whole batch's with the fix, 4x it (the sum) without.
    ids = torch.randint(5, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    grads = {}
    for fix in (True, False):
        t = trainer(lora(BertForMaskedLM(BertConfig(**config))), fix=fix)
        t.current_gradient_accumulation_steps = 4
        t.model.zero_grad()
        for i in range(4):
            t.training_step(
                t.model, {k: v[i : i + 1] for k, v in batch.items()}, num_items_in_batch=torch.tensor(32)
            )
        grads[fix] = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
    reference = lora(BertForMaskedLM(BertConfig(**config)))
    reference(**batch).loss.backward()
    whole = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert set(whole) == set(grads[True]) and all("lora" in n for n in whole)
    for name, g in whole.items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(grads[False][name], 4 * g, rtol=1e-4, atol=1e-6, msg=name)

    # A run says so in its event log.
    from datasets import Dataset

    t = trainer(lora(BertForMaskedLM(BertConfig(**config))), max_steps=1, per_device_train_batch_size=1)
    t.train_dataset = Dataset.from_dict({k: v.tolist() for k, v in batch.items()})
    t.train()
    (event,) = [
        e
        for e in read_run_events(tmp_path / "out" / "loss_scale_log.jsonl")
        if e["event"] == "loss_normalisation"
    ]
    assert event["model"] == "BertForMaskedLM" and event["gradient_accumulation_steps"] == 4


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_logged_grad_norm_is_torchs_unscaled_norm(tmp_path, monkeypatch, optim):
    """The Trainer clips through `DynamicLossScaler.clip_grad_norm_` (routed by the Accelerate hook);
    its logged `grad_norm` must be the norm torch's unscale_ + clip_grad_norm_ sequence gives
    (Accelerate's own clip_grad_norm_), step by step, with an overflow in the run. Bug caught:
    the scaled norm logged (x1024), or the routed path diverging from torch's."""
    from hf_lossscale.core import scaler as scaler_module
    from hf_lossscale.integrations import accelerate_hook

    calls = []
    routed_clip = scaler_module.DynamicLossScaler.clip_grad_norm_

    def spy(self, *args, **kwargs):
        calls.append(1)
        return routed_clip(self, *args, **kwargs)

    monkeypatch.setattr(scaler_module.DynamicLossScaler, "clip_grad_norm_", spy)
    runs = {}
    for routed in (True, False):
        if not routed:
            monkeypatch.setattr(accelerate_hook, "_single_optimizer_of", lambda *a: None)
        trainer, rec, _, _ = train(
            tmp_path / str(routed), bad_steps=(4,), optim=optim, logging_steps=1, max_grad_norm=0.5,
            loss_scale_fp16_on_cpu="emulate",
        )  # fmt: skip
        norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        runs[routed] = (norms, rec.weights[-1], len(calls))
        calls.clear()
    (ours, w_ours, n_ours), (theirs, w_theirs, n_theirs) = runs[True], runs[False]
    assert n_ours == 12 and n_theirs == 0
    assert len(ours) == len(theirs) == 12 and max(theirs[:4]) > 0.5  # it clipped
    if optim == "adamw_torch":  # foreach AdamW: bitwise
        assert ours[:4] == theirs[:4] and ours[5:] == theirs[5:] and torch.equal(w_ours, w_theirs)
    else:  # fused: the kernel divides by scale / coefficient, within an ulp per step
        torch.testing.assert_close(ours[5:], theirs[5:], rtol=1e-6, atol=0)
        torch.testing.assert_close(w_ours, w_theirs, rtol=1e-6, atol=1e-7)
    assert ours[:4] == theirs[:4]  # same gradients until the first clipped step differs


# ---------------------------------------------------------------- logs that keep their meaning (issue 48)
def _strict_loads(line):
    def refuse(constant):
        raise ValueError(f"non-strict JSON constant {constant}")

    return json.loads(line, parse_constant=refuse)


def _trainer_with_eval(tmp_path, bad_steps=(), **kw):
    trainer = InjectingTrainer(
        model=tiny_bert_classifier(),
        args=make_args(tmp_path, **kw),
        train_dataset=tiny_classification_dataset(),
        eval_dataset=tiny_classification_dataset(n=16),
    )
    trainer.bad_steps = bad_steps
    return trainer


SCALER_KEYS = {"loss_scale", "skipped_steps", "overflow_rate", "nonfinite_loss_steps", "fp16_emulated"}


def test_evaluation_leaves_the_training_window_and_its_results_alone(tmp_path):
    """Steps 1-2 hold one skip (step 2's loss is non-finite); an evaluation after step 1
    (eval_steps=1) used to read the scaler and reset the "since the last log" window, so the log at
    step 2 said overflow_rate 0.0; and evaluation metrics (eval_results.json) carried loss_scale,
    overflow_rate and skipped_steps. Issue 48."""
    trainer = _trainer_with_eval(
        tmp_path, bad_steps=(1,), max_steps=4, logging_steps=2, eval_strategy="steps", eval_steps=1,
        per_device_eval_batch_size=8, loss_scale_telemetry_interval=1,
    )  # fmt: skip
    trainer.train()
    history = trainer.state.log_history
    training = [e for e in history if "loss" in e]
    evals = [e for e in history if "eval_loss" in e]
    summary = [e for e in history if "train_runtime" in e]
    assert [e["step"] for e in training] == [2, 4] and len(evals) == 4 and len(summary) == 1
    assert training[0]["overflow_rate"] == 0.5 and training[0]["skipped_steps"] == 1
    assert training[1]["overflow_rate"] == 0.0
    # the telemetry snapshot goes to the training log that follows, at the step it was measured at
    assert training[0]["grad_telemetry_step"] == 2 and training[1]["grad_telemetry_step"] == 4
    for e in evals + summary:
        assert not (SCALER_KEYS | {"grad_zero_frac", "headroom_bits"}) & set(e), e
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics and not SCALER_KEYS & set(metrics)
    assert trainer.loss_scaler.stats()["skipped_steps"] == 1


def test_logs_and_event_log_are_strict_json(tmp_path):
    """An overflow on a telemetry step gives headroom_bits -inf, and a skipped step an infinite
    grad_norm: the event log used to write `-Infinity` (strict parsers reject it). Every line of the
    event log and trainer_state.json parses strictly; the non-finite figures read null."""
    trainer, _, _, _ = train(tmp_path, bad_steps=(4,), max_steps=6, logging_steps=1, save_strategy="steps",
                             save_steps=6, loss_scale_telemetry_interval=1)  # fmt: skip
    lines = (tmp_path / "out" / "loss_scale_log.jsonl").read_text().splitlines()
    events = [_strict_loads(line) for line in lines]
    telemetry = [e for e in events if e["event"] == "telemetry"]
    assert [e["step"] for e in telemetry] == [1, 2, 3, 4, 5, 6]
    assert telemetry[4]["headroom_bits"] is None and telemetry[4]["overflow_frac"] > 0  # step 5: inf/NaN
    assert all(isinstance(e["headroom_bits"], float) for i, e in enumerate(telemetry) if i != 4)
    logs = [e for e in events if e["event"] == "log" and "loss" in e]
    assert logs[4]["step"] == 5 and logs[4]["headroom_bits"] is None
    state = (tmp_path / "out" / "checkpoint-6" / "trainer_state.json").read_text()
    history = _strict_loads(state)["log_history"]
    assert history[4]["headroom_bits"] is None


def test_a_loss_averaged_over_non_finite_steps_says_so(tmp_path, caplog):
    """transformers' logging_nan_inf_filter counts a non-finite loss as the window's running mean,
    0 when it comes first: the log at step 2 read loss 0.0 with no word. Now it counts them
    (`loss_nonfinite_in_window`) and warns."""
    with caplog.at_level("WARNING", logger="hf_lossscale.integrations.trainer"):
        trainer, _, _, _ = train(tmp_path, bad_steps=(0, 1), max_steps=4, logging_steps=2)
    training = [e for e in trainer.state.log_history if "loss" in e]
    assert training[0]["loss"] == 0.0  # transformers' figure, unchanged
    assert training[0]["loss_nonfinite_in_window"] == 2 and training[1]["loss_nonfinite_in_window"] == 0
    said = [r.getMessage() for r in caplog.records if "averages" in r.getMessage()]
    assert len(said) == 1 and "step 2 averages 2" in said[0] and "logging_nan_inf_filter" in said[0]


def test_grad_zero_frac_leaves_out_untouched_rows(tmp_path):
    """The tiny BERT's embedding rows of tokens not in the batch are zero throughout: they used to be
    most of grad_zero_frac. Now grad_untouched_frac holds them and grad_zero_frac the zeros in rows
    that received a gradient; the two add up to the old figure (the snapshot's zero_frac)."""
    trainer, _, _, _ = train(tmp_path, max_steps=2, logging_steps=2, loss_scale_telemetry_interval=1)
    log = next(e for e in trainer.state.log_history if "loss" in e)
    events = [
        _strict_loads(line) for line in (tmp_path / "out" / "loss_scale_log.jsonl").read_text().splitlines()
    ]
    snapshot = next(e for e in events if e.get("source") == "param_grads")
    embeddings = snapshot["per_module"]["bert.embeddings"]
    # every zero of the embeddings is a row the batch did not touch (measured: 43% of its elements)
    assert embeddings["untouched_frac"] == embeddings["zero_frac"] > 0.3
    assert embeddings["touched_zero_frac"] == 0.0
    # across the model: untouched rows 8%, zeros in touched rows 0.03% (old grad_zero_frac: their sum)
    assert log["grad_untouched_frac"] > 0.05 and log["grad_zero_frac"] < 0.1 * log["grad_untouched_frac"]
    assert log["grad_zero_frac"] + log["grad_untouched_frac"] == pytest.approx(snapshot["zero_frac"])


def test_a_loss_scale_keyword_with_plain_training_arguments_names_the_fix(tmp_path):
    """`LossScaleTrainer(..., loss_scale_init=...)` raised the Trainer's bare TypeError; the error
    names LossScaleTrainingArguments and loss_scale_config=, with the user's value in both."""
    args = TrainingArguments(str(tmp_path), fp16=True, report_to=[], max_steps=2)
    with pytest.raises(TypeError) as err:
        LossScaleTrainer(model=tiny_bert_classifier(), args=args, train_dataset=tiny_classification_dataset(),
                         loss_scale_init=1024.0, loss_scale_hysteresis=2)  # fmt: skip
    message = str(err.value)
    assert "LossScaleTrainingArguments(..., loss_scale_init=1024.0, loss_scale_hysteresis=2)" in message
    assert "loss_scale_config=LossScaleConfig(init_scale=1024.0, hysteresis=2)" in message
    assert "plain `TrainingArguments`" in message
    with pytest.raises(TypeError, match="not loss-scale settings"):
        LossScaleTrainer(tiny_bert_classifier(), args, loss_scale_intt=1024.0)


def test_resume_takes_every_setting_from_this_run_and_says_what_differs(tmp_path, caplog, recwarn):
    """Resumed with other settings, the Trainer kept the checkpoint's growth_interval (torch's
    load_state_dict restores it) but took hysteresis and min_scale from the flags: two sources.
    Now every setting is this run's, the checkpoint gives the dynamic state (scale, counters), and
    one line names what differs. Issue 48."""
    kw = dict(save_strategy="steps", save_steps=4, max_steps=4, loss_scale_growth_interval=3)
    first, *_ = train(tmp_path, bad_steps=(1,), **kw)
    saved = first.loss_scaler.stats()
    ckpt = tmp_path / "out" / "checkpoint-4"
    args = make_args(tmp_path, max_steps=4, save_strategy="no", loss_scale_growth_interval=7,
                     loss_scale_hysteresis=2, loss_scale_min=4.0)  # fmt: skip
    resumed = InjectingTrainer(
        model=tiny_bert_classifier(), args=args, train_dataset=tiny_classification_dataset()
    )
    with caplog.at_level("WARNING", logger="hf_lossscale.integrations.trainer"):
        resumed._load_scaler(str(ckpt))
    config = resumed.loss_scaler.config
    assert (config.growth_interval, config.hysteresis, config.min_scale) == (7, 2, 4.0)
    stats = resumed.loss_scaler.stats()
    for key in ("loss_scale", "total_steps", "skipped_steps"):
        assert stats[key] == saved[key], key
    lines = [r.getMessage() for r in caplog.records if "resumed the loss scaler" in r.getMessage()]
    assert len(lines) == 1
    assert "growth_interval 7 (checkpoint 3)" in lines[0] and "hysteresis 2 (checkpoint 1)" in lines[0]
    assert "min_scale 4.0 (checkpoint 1.0)" in lines[0] and "init_scale" not in lines[0]
    assert not [w for w in recwarn if "config" in str(w.message) or "Restored" in str(w.message)]


def test_a_non_finite_evaluation_is_logged_null_and_returned_as_a_number(tmp_path):
    """Found by pure FP16 on SST-2 (its weights went NaN): evaluate() returned the log's dict with None
    for the NaN eval loss, and transformers' own `trainer.log_metrics("eval", metrics)` (in every example
    script) raised a TypeError formatting it. The stock Trainer returns NaN; the logs still read null."""
    trainer = LossScaleTrainer(model=tiny_bert_classifier(), args=make_args(tmp_path, fp16=False, max_steps=1),
                               train_dataset=tiny_classification_dataset(),
                               eval_dataset=tiny_classification_dataset(n=8))  # fmt: skip
    with torch.no_grad():
        trainer.model.classifier.weight.fill_(float("nan"))
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] != metrics["eval_loss"]  # NaN
    trainer.log_metrics("eval", metrics)
    assert trainer.state.log_history[-1]["eval_loss"] is None
