"""`hf-lossscale path [NAME]`: the files the package ships for its commands, where they are installed.

The `accelerate` launch configs (`configs/*.yaml`, every key commented) and a small offline sample
(`sample/`: `text.txt`, 224 lines of prose for language modelling; `sst2_train.tsv` and
`sst2_validation.tsv`, 46 and 16 SST-2-style rows with `sentence` and `label` columns) live in
`hf_lossscale/recipes/`, so the documented offline commands run from an installed package:

    accelerate launch --config_file "$(hf-lossscale path cpu.yaml)" -m hf_lossscale.recipes.text_classification \\
        --do_train --do_eval --model_name_or_path MODEL --output_dir runs/sst2-sample --fp16 --max_steps 20 \\
        --train_file "$(hf-lossscale path sst2_train.tsv)" --validation_file "$(hf-lossscale path sst2_validation.tsv)"

Without NAME it lists every file; a NAME is a file's name (`cpu.yaml`) or its path under the recipes
package (`configs/cpu.yaml`). The sample is for trying a command, not for a measurement: SST-2
itself, WikiText-2 and tiny-shakespeare are what the benchmarks use.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

__all__ = ["packaged_files", "packaged_path", "add_path_arguments", "run"]

#: the folders of `hf_lossscale/recipes` that hold shipped files (package data in pyproject.toml)
FOLDERS = ("configs", "sample")


def packaged_files() -> dict[str, Path]:
    """Every shipped file: its path under the recipes package (`configs/cpu.yaml`) -> where it is."""
    root = Path(str(resources.files("hf_lossscale.recipes")))
    return {
        f"{folder}/{p.name}": p
        for folder in FOLDERS
        for p in sorted((root / folder).iterdir())
        if p.is_file() and not p.name.startswith(".")
    }


def packaged_path(name: str) -> Path:
    """Where the shipped file `name` is: a file's name (`cpu.yaml`) or its path under the recipes
    package (`configs/cpu.yaml`). Raises `FileNotFoundError` listing the files there are."""
    files = packaged_files()
    if name in files:
        return files[name]
    matches = [path for key, path in files.items() if key.rsplit("/", 1)[-1] == name]
    if len(matches) == 1:
        return matches[0]
    raise FileNotFoundError(f"No shipped file {name!r}; the package ships: {', '.join(files)}.")


def add_path_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "name",
        nargs="?",
        default=None,
        help="cpu.yaml, configs/fsdp_fp16.yaml, sst2_train.tsv, text.txt, ... (none: list them all).",
    )


def run(name: str | None) -> int:
    """Print the path of `name`, or every shipped file's name and path; 2 for an unknown name."""
    if name is None:
        for key, path in packaged_files().items():
            print(f"{key}\t{path}")
        return 0
    try:
        print(packaged_path(name))
    except FileNotFoundError as error:
        print(error, file=sys.stderr)
        return 2
    return 0
