"""TRL's trainers under the loss scaler: a tiny decoder built from a config, FP16 emulated on the CPU."""

import pytest
import torch
from tiny_models import minilm_path
from transformers import TrainerCallback

pytest.importorskip("trl")

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "to be or not to be", "all that glitters"] * 6


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path())
    tok.bos_token, tok.eos_token = tok.cls_token, tok.sep_token
    return tok


def tiny_decoder(tokenizer, seed=0):
    """A 2-layer, 32-wide Llama (RMSNorm, rotary, SwiGLU) with MiniLM's vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id,
                         eos_token_id=tokenizer.sep_token_id)  # fmt: skip
    return LlamaForCausalLM(config)


class LrRecorder(TrainerCallback):
    def __init__(self):
        self.lrs = []

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        self.lrs.append(lr_scheduler.get_last_lr()[0])


def sft(tmp_path, tokenizer, bad_steps=(), resume=None, half=False, **kw):
    from datasets import Dataset

    from hf_lossscale.integrations.trl_trainers import FP16SFTConfig, FP16SFTTrainer

    class Injecting(FP16SFTTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            out = super().compute_loss(model, inputs, *args, **kwargs)
            if self.state.global_step in bad_steps:
                out = (out[0] * float("inf"), *out[1:]) if isinstance(out, tuple) else out * float("inf")
            return out

    settings = dict(output_dir=str(tmp_path / "out"), fp16=True, max_steps=6, per_device_train_batch_size=4,
                    logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, max_length=32,
                    learning_rate=1e-3, lr_scheduler_type="linear", loss_scale_init=1024.0,
                    loss_scale_growth_interval=2,
                    # the injected overflow is in the loss; back off on it as torch does, to see the scale move
                    loss_scale_backoff_on_nonfinite_loss=True)  # fmt: skip
    args = FP16SFTConfig(**{**settings, **kw})
    recorder = LrRecorder()
    model = tiny_decoder(tokenizer).half() if half else tiny_decoder(tokenizer)
    trainer = Injecting(model=model, args=args, train_dataset=Dataset.from_dict({"text": TEXTS}),
                        processing_class=tokenizer, callbacks=[recorder])  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    return trainer, recorder


def test_sft_trains_logs_the_scale_and_skips_the_scheduler_on_overflow(tmp_path, tokenizer):
    """Bugs caught: the mixin not reaching TRL's trainer (no `loss_scale` in its logs, the scale never
    moving), an overflowed step stepping the LR scheduler or the scale not backing off."""
    from hf_lossscale import DynamicLossScaler

    trainer, recorder = sft(tmp_path, tokenizer, bad_steps=(2,))
    assert isinstance(trainer.loss_scaler, DynamicLossScaler)
    logs = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    assert [logs[s]["loss_scale"] for s in range(1, 7)] == [1024, 2048, 1024, 1024, 2048, 2048]
    assert [logs[s]["skipped_steps"] for s in range(1, 7)] == [0, 0, 1, 1, 1, 1]
    assert recorder.lrs[2] == recorder.lrs[1]  # the skipped step (index 2) left the LR where it was
    assert all(recorder.lrs[i] < recorder.lrs[i - 1] for i in range(1, 6) if i != 2)
    assert logs[1]["fp16_emulated"] == 1.0 and "mean_token_accuracy" in logs[1]  # TRL's own figures stay
    assert logs[6]["loss"] < logs[1]["loss"]


def test_sft_resumes_with_the_scalers_state(tmp_path, tokenizer):
    """Bug caught: a resumed TRL run starting a fresh scaler (init scale) instead of the checkpoint's."""
    whole, _ = sft(tmp_path / "whole", tokenizer, bad_steps=(2,))
    first, _ = sft(tmp_path / "cut", tokenizer, bad_steps=(2,), save_strategy="steps", save_steps=4)
    checkpoint = tmp_path / "cut" / "out" / "checkpoint-4"
    assert checkpoint.is_dir()
    resumed, _ = sft(tmp_path / "cut", tokenizer, bad_steps=(2,), resume=str(checkpoint))
    assert resumed.loss_scaler.stats() == whole.loss_scaler.stats()
    final = [e for e in resumed.state.log_history if "loss" in e]
    assert final[-1]["step"] == 6 and final[-1]["loss_scale"] == 2048


@pytest.mark.parametrize("which", ["dpo", "grpo"])
def test_dpo_and_grpo_train_under_the_scaler(which, tmp_path, tokenizer):
    """TRL's preference (DPO) and RL (GRPO: generation, reward, policy loss) trainers on the CPU."""
    from datasets import Dataset

    from hf_lossscale import DynamicLossScaler
    from hf_lossscale.integrations.trl_trainers import (
        FP16DPOConfig,
        FP16DPOTrainer,
        FP16GRPOConfig,
        FP16GRPOTrainer,
    )

    common = dict(output_dir=str(tmp_path / "out"), fp16=True, max_steps=3, per_device_train_batch_size=4,
                  logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, loss_scale_init=1024.0)  # fmt: skip
    if which == "dpo":
        init = tmp_path / "init"  # DPO builds its reference model from the policy's folder
        tiny_decoder(tokenizer).save_pretrained(init)
        tokenizer.save_pretrained(init)
        data = Dataset.from_dict({"prompt": ["the cat"] * 12, "chosen": [" sat on the mat"] * 12,
                                  "rejected": [" ran away"] * 12})  # fmt: skip
        trainer = FP16DPOTrainer(model=str(init), args=FP16DPOConfig(**common, max_length=32), train_dataset=data,
                                 processing_class=tokenizer)  # fmt: skip
    else:
        data = Dataset.from_dict({"prompt": ["the cat", "a dog"] * 6})
        trainer = FP16GRPOTrainer(model=tiny_decoder(tokenizer), processing_class=tokenizer, train_dataset=data,
                                  reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                                  args=FP16GRPOConfig(**common, max_completion_length=8, num_generations=2,
                                                      generation_batch_size=4))  # fmt: skip
    trainer.train()
    assert isinstance(trainer.loss_scaler, DynamicLossScaler)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 3 and all(e["loss_scale"] > 0 and e["fp16_emulated"] == 1.0 for e in logs)
    assert trainer.loss_scaler.stats()["total_steps"] == 3


def test_sft_trains_a_model_held_in_fp16_on_fp32_masters(tmp_path, tokenizer):
    """TRL's SFT trainer with the model held in FP16 (`master_weights="auto"`): the optimizer steps
    FP32 masters, the model keeps FP16 weights equal to its masters rounded, an overflowed step moves
    nothing, and the loss falls. Bugs caught: "Attempting to unscale FP16 gradients" (no masters in
    TRL's optimizer path), the optimizer stepping the FP16 weights themselves (moments in FP16)."""
    trainer, recorder = sft(tmp_path, tokenizer, bad_steps=(2,), half=True)
    masters = trainer.loss_scaler.master_weights.pairs(trainer.optimizer)
    assert masters and all(h.dtype == torch.float16 and m.dtype == torch.float32 for h, m in masters)
    assert all(torch.equal(h, m.half()) for h, m in masters)
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    moments = [
        v for m in (m for _, m in masters) for k, v in inner.state[m].items() if k.startswith("exp_avg")
    ]
    assert moments and all(v.dtype == torch.float32 for v in moments)
    logs = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    assert logs[6]["skipped_steps"] == 1 and logs[6]["loss"] < logs[1]["loss"]
    assert recorder.lrs[2] == recorder.lrs[1]
