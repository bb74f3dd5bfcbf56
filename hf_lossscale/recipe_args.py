"""Command-line parsing for the recipes and for your own scripts: `HfArgumentParser` plus
`--config file.yaml`, whose keys are flag names and set defaults that command-line flags override.

Example:

```python
>>> from hf_lossscale.recipe_args import make_parser, parse_args
>>> from hf_lossscale import LossScaleTrainingArguments
>>> parser = make_parser(LossScaleTrainingArguments)
>>> (training_args,) = parse_args(parser, ["--config", "run.yaml", "--max_steps", "10"])  # doctest: +SKIP
```
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import HfArgumentParser

from .config import read_config_file

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
        kind = action.type
        if isinstance(value, str) and callable(kind):
            try:
                value = kind(value)
            except (TypeError, ValueError) as err:
                raise ValueError(f"Recipe config file {path!r}: {name}={value!r}: {err}") from None
        elif kind in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"Recipe config file {path!r}: {name}={value!r} is not a number.")
        elif kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(f"Recipe config file {path!r}: {name}={value!r} is not an integer.")
        if action.choices is not None and value not in action.choices:
            raise ValueError(
                f"Recipe config file {path!r}: {name}={value!r} is not one of {list(action.choices)}."
            )
        defaults[name] = int(value) if kind is int and isinstance(value, float) else value
    parser.set_defaults(**defaults)


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
