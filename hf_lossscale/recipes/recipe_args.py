"""Command-line parsing for the recipes (and for your own scripts: copy this file beside them):
`HfArgumentParser` plus `--config file.yaml`, whose keys are flag names and set defaults that
command-line flags override.

Example:

```python
>>> from hf_lossscale.recipes.recipe_args import make_parser, parse_args
>>> from hf_lossscale import LossScaleTrainingArguments
>>> parser = make_parser(LossScaleTrainingArguments)
>>> (training_args,) = parse_args(parser, ["--config", "run.yaml", "--max_steps", "10"])  # doctest: +SKIP
```
"""

from __future__ import annotations

import argparse
import csv
import glob
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import HfArgumentParser

from hf_lossscale.core.config import read_config_file

__all__ = ["make_parser", "parse_args", "ModelArguments", "data_files_builder"]


def make_parser(*dataclass_types: type, description: str | None = None) -> HfArgumentParser:
    """An `HfArgumentParser` over `dataclass_types` with a `--config FILE` option."""
    parser = HfArgumentParser(
        dataclass_types, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="YAML or JSON file mapping flag names to values; flags given on the command line win.",
    )
    return parser


def parse_args(parser: HfArgumentParser, argv: Sequence[str] | None = None) -> tuple[Any, ...]:
    """Parse `argv` into the parser's dataclasses, with the `--config` file's values as defaults.

    Raises:
        ValueError: the config file is unreadable, not a mapping, or has keys that are not flags
            (the message names the file and the keys).
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config is not None:
        _apply_config_file(parser, known.config)
    outputs = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    # The `--config` value comes back as an extra namespace: drop it.
    return tuple(o for o in outputs if not isinstance(o, argparse.Namespace))


def _apply_config_file(parser: HfArgumentParser, path: str) -> None:
    values = read_config_file(path, what="recipe config")
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ValueError(
            f"Recipe config file {path!r} must hold a mapping of flag names to values, "
            f"got {type(values).__name__}."
        )
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    unknown = sorted(set(values) - set(actions))
    if unknown:
        raise ValueError(
            f"Recipe config file {path!r}: unknown keys {unknown}. Keys are flag names without the "
            "leading '--' (see --help)."
        )
    defaults = {}
    for name, value in values.items():
        action = actions[name]
        action.required = False  # the file supplies it
        if action.nargs in ("+", "*"):  # a list flag (e.g. report_to): a list, or one value
            items = value if isinstance(value, list) else [value]
            defaults[name] = [_config_value(path, name, action, v) for v in items]
        else:
            defaults[name] = _config_value(path, name, action, value)
    parser.set_defaults(**defaults)


def _shown(value: Any) -> str:
    """A value as quoted in an error, cut to a readable length."""
    text = repr(value)
    return text if len(text) <= 120 else f"{text[:120]}... ({len(text) - 120} more characters)"


def _config_value(path: str, name: str, action: argparse.Action, value: Any) -> Any:
    """One value of the recipe config file, checked against its flag's type (as the command line
    would parse it): a mapping or list for a single value, a number for a true/false flag, a
    fraction for an integer are refused, naming the file, the key and the value."""
    where = f"Recipe config file {path!r}: {name}={_shown(value)}"
    kind = action.type
    if isinstance(value, (dict, list)):
        what = "not a number" if kind in (int, float) else f"a {type(value).__name__}"
        raise ValueError(f"{where} is {what}; {name} takes a single value.")
    is_bool = getattr(kind, "__name__", "") == "string_to_bool" or isinstance(action.const, bool)
    if is_bool and not isinstance(value, (bool, str)):
        raise ValueError(f"{where} is not true or false.")
    if isinstance(value, str) and callable(kind):
        try:
            value = kind(value)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: {_shown(err)}") from None
    elif kind in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"{where} is not a number.")
    elif kind is int and isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{where} is not an integer.")
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where} is not one of {list(action.choices)}.")
    return int(value) if kind is int and isinstance(value, float) else value


@dataclass
class ModelArguments:
    """Which model, config and tokenizer to fine-tune (the flags of transformers' example scripts)."""

    model_name_or_path: str = field(
        metadata={"help": "A Hub model id (e.g. bert-base-uncased) or a local folder with a saved model."}
    )
    config_name: str | None = field(
        default=None, metadata={"help": "Config name or path, if not the model's."}
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer name or path, if not the model's."}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where to store downloads from the Hub."})
    model_revision: str = field(
        default="main", metadata={"help": "Branch, tag or commit of the model on the Hub."}
    )
    token: str | None = field(default=None, metadata={"help": "Hub token for private models or data sets."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow models and data sets that run their own code from the Hub."}
    )
    dtype: str | None = field(
        default=None,
        metadata={
            "help": "Load the model's weights in this dtype (as run_clm.py's --dtype): float16 holds them in FP16 "
            "(with --fp16 the optimizer steps on FP32 master weights), float32, bfloat16, or auto (the "
            "checkpoint's own). Default: transformers' (the checkpoint's own).",
            "choices": ["auto", "float16", "bfloat16", "float32"],
        },
    )

    def model_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the model's own `from_pretrained` call: the Hub's and `dtype`."""
        if self.dtype is None:
            return self.hub_kwargs()
        import torch

        return {**self.hub_kwargs(), "dtype": "auto" if self.dtype == "auto" else getattr(torch, self.dtype)}

    def hub_kwargs(self) -> dict[str, Any]:
        """The keyword arguments every `from_pretrained` call of a recipe takes."""
        return {
            "cache_dir": self.cache_dir,
            "revision": self.model_revision,
            "token": self.token,
            "trust_remote_code": self.trust_remote_code,
        }


def data_files_builder(files: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """The `load_dataset` builder name and options for local csv/tsv/json/jsonl/txt files."""
    suffixes = {Path(f).suffix.lower() for f in files.values()}
    if len(suffixes) != 1:
        raise ValueError(f"The data files {files} must all have the same extension, got {sorted(suffixes)}.")
    suffix = suffixes.pop()
    if suffix == ".tsv":
        # GLUE's tsv files quote nothing; a '"' inside a sentence is part of it.
        return "csv", {"delimiter": "\t", "quoting": csv.QUOTE_NONE}
    if suffix == ".csv":
        return "csv", {}
    if suffix in (".json", ".jsonl"):
        return "json", {}
    if suffix == ".txt":
        return "text", {}
    raise ValueError(
        f"Unsupported data file extension {suffix!r} in {files}: use csv, tsv, json, jsonl or txt."
    )


def setup_run(parser: HfArgumentParser, argv: Sequence[str] | None = None) -> tuple[Any, ...]:
    """What every recipe does first: parse (with `--config`), set up logging, check that there is
    something to do, seed. Returns the parsed dataclasses; the `TrainingArguments` come last."""
    import logging
    import sys

    import transformers

    parsed = parse_args(parser, argv)
    training_args = parsed[-1]
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO, stream=sys.stdout
    )
    transformers.utils.logging.set_verbosity(training_args.get_process_log_level())
    if not (training_args.do_train or training_args.do_eval):
        raise ValueError("Nothing to do: pass --do_train and/or --do_eval.")
    if not training_args.do_train:
        logging.getLogger(__name__).warning(
            "--do_train not given: evaluating the model as loaded, without training."
        )
    transformers.set_seed(training_args.seed)
    return parsed


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def first_row(path: str, options: dict[str, Any]) -> list[str]:
    """The first row of a csv/tsv file, split as the `csv` builder will split it."""
    with open(path, newline="", encoding="utf-8") as f:
        quoting = options.get("quoting", csv.QUOTE_MINIMAL)
        return next(csv.reader(f, delimiter=options.get("delimiter", ","), quoting=quoting), [])


def looks_like_header(row: list[str]) -> bool:
    """A header names its columns: no empty, numeric or repeated field."""
    names = [f.strip() for f in row]
    return bool(names) and all(names) and len(set(names)) == len(names) and not any(map(_is_number, names))


def _columns_of(path: str, options: dict[str, Any], data: Any, headerless: Any) -> list[str] | None:
    """`column_names` for a headerless csv/tsv file; None when its first row is a header."""
    given = getattr(data, "column_names", None)
    if given:
        return [n.strip() for n in given.split(",")]
    row = first_row(path, options)
    if looks_like_header(row):
        return None
    names = headerless(path, row) if headerless is not None else None
    if names is None:
        raise ValueError(
            f"{path}: the first row {row!r} is not a header (it has empty, numeric or repeated fields), "
            "so the file's columns are unnamed. Pass --column_names with one name per column "
            f"({len(row)} here, comma-separated)"
            + (", or --task_name for GLUE's own files." if hasattr(data, "task_name") else ".")
        )
    return names


def load_raw_datasets(data: Any, model: ModelArguments, *, shuffle_split: bool = True,
                      headerless: Any = None) -> Any:  # fmt: skip
    """`train` and `validation` splits from the Hub (`data.dataset_name`) or local files
    (`data.train_file`, `data.validation_file`, and `data.validation_mismatched_file` where the
    recipe has it); without a validation split, `data.validation_split_percentage` of train is held
    out (seed 0).

    Each local file is read on its own, so splits may have different columns (GLUE's MNLI dev files
    have more than its train file). A csv/tsv file without a header row is read with
    `data.column_names` (comma-separated), else with `headerless(path, first_row)`'s names; when
    neither names them, the error names the file, its first row and the flag to pass."""
    from datasets import DatasetDict, load_dataset

    if data.dataset_name is not None:
        raw = load_dataset(
            data.dataset_name, data.dataset_config_name, cache_dir=model.cache_dir, token=model.token
        )
    else:
        files = {"train": data.train_file}
        if data.validation_file:
            files["validation"] = data.validation_file
        if getattr(data, "validation_mismatched_file", None):
            files["validation_mismatched"] = data.validation_mismatched_file
        builder, options = data_files_builder(files)
        raw = DatasetDict()
        for split, path in files.items():
            matches = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
            if not matches or not Path(matches[0]).is_file():
                raise FileNotFoundError(f"--{split}_file {path!r}: no such file.")
            extra = dict(options)
            if builder == "csv":
                names = _columns_of(matches[0], options, data, headerless)
                if names is not None:
                    extra["column_names"] = names
            for match in matches:
                check_data_file(f"--{split}_file", match, text=builder == "text")
            try:
                loaded = load_dataset(builder, data_files={split: path}, cache_dir=model.cache_dir, **extra)
            except Exception as err:  # datasets' DatasetGenerationError names neither the file nor why
                cause = err.__cause__ or err
                reason = f"{type(cause).__name__}: {cause}"
                reason = reason if len(reason) <= 300 else reason[:300] + "..."
                raise ValueError(
                    f"--{split}_file {path!r}: could not be read as {builder}: {reason}"
                ) from None
            raw[split] = loaded[split]
    if "validation" not in raw and "validation_matched" in raw:  # GLUE MNLI
        raw["validation"] = raw["validation_matched"]
    if "validation" not in raw:
        rows = len(raw["train"])
        held_out = math.ceil(rows * data.validation_split_percentage / 100)
        if rows - held_out < 1:  # sklearn's "the resulting train set will be empty"
            where = f"--train_file {data.train_file!r}" if data.dataset_name is None else data.dataset_name
            raise ValueError(
                f"{where} has {rows} row(s): too few to hold out {data.validation_split_percentage}% for "
                "evaluation and train on the rest; give more text or a --validation_file."
            )
        split = raw["train"].train_test_split(
            test_size=data.validation_split_percentage / 100, seed=0, shuffle=shuffle_split
        )
        raw["train"], raw["validation"] = split["train"], split["test"]
    return raw


def check_data_file(flag: str, path: str, *, text: bool) -> None:
    """Refuse a local data file that cannot be what the flag wants, naming it and why: empty,
    UTF-16 (a byte-order mark), binary (NUL bytes, not UTF-8), or, for a text file, only blank lines
    (the text builder would train on nothing without a word)."""
    import codecs

    shown = repr(path) if len(path) <= 300 else repr(path[:300] + "...")
    with open(path, "rb") as f:
        head = f.read(1 << 20)
        if not head:
            raise ValueError(f"{flag} {shown} is empty.")
        if head.startswith(
            (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE, codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)
        ):
            raise ValueError(f"{flag} {shown} is UTF-16/32 text (a byte-order mark): save it as UTF-8.")
        if b"\0" in head:
            raise ValueError(f"{flag} {shown} holds NUL bytes: a binary file, or UTF-16 text without a mark?")
        try:
            codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        except UnicodeDecodeError as err:
            raise ValueError(f"{flag} {shown} is not UTF-8 text (byte {err.start}: {err.reason}).") from None
        if text:
            chunk = head
            while chunk and not chunk.strip():
                chunk = f.read(1 << 20)
            if not chunk.strip():
                raise ValueError(f"{flag} {shown} holds only blank lines: no text to train on.")


def _eval_at_last_step(trainer: Any, training_args: Any) -> dict[str, float] | None:
    """The periodic evaluation the Trainer already ran after the final step, when the model has not
    changed since (no best-model reload): evaluating again would only repeat it."""
    if not training_args.do_train or getattr(training_args, "load_best_model_at_end", False):
        return None
    history = trainer.state.log_history
    last = next((e for e in reversed(history) if "eval_loss" in e), None)
    if last is None or last.get("step") != trainer.state.global_step:
        return None
    # the log history holds a non-finite figure as null (LossScaleMixin.log): a number again here
    return {k: math.nan if v is None else v for k, v in last.items() if k.startswith("eval_")}


def train_and_evaluate(trainer: Any, training_args: Any, train_dataset: Any, eval_dataset: Any,
                       extra_eval: Any = None) -> dict[str, float]:  # fmt: skip
    """Train (resuming if asked), save model, metrics and state; evaluate; as transformers'
    example scripts do. `extra_eval(metrics)` adds figures to the eval metrics (e.g. perplexity)."""
    metrics: dict[str, float] = {}
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        metrics.update(result.metrics)
        metrics["train_samples"] = len(train_dataset)
        trainer.save_model()
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
        trainer.save_state()
    if training_args.do_eval:
        eval_metrics = _eval_at_last_step(trainer, training_args) or trainer.evaluate()
        eval_metrics["eval_samples"] = len(eval_dataset)
        if extra_eval is not None:
            extra_eval(eval_metrics)
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)
        metrics.update(eval_metrics)
    return metrics
