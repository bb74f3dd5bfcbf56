"""`hf-lossscale preflight`: will this checkpoint train in FP16? Checked before the first step.

Two measurements on a few real batches:

1. **FP32 passes** (forward + backward, no optimizer step): per module, the largest activation it
   outputs and the range of the gradient at its output, against FP16's window: 65504 at the top,
   2^-24 at the bottom, in bits of margin (`log2(65504 / max)`, `log2(min / 2^-24)`). A module whose
   activations exceed 65504 cannot run in FP16 at any loss scale.
2. **FP16 replays** (`fp16_emulation` on the CPU, autocast on CUDA): the forward-overflow origin, as
   training's diagnosis finds it (`hf_lossscale.core.overflow`); it is run in FP32 and the batch replayed
   until no forward overflows (at most `max_modules`): the `fp32_modules` that `"auto"` would reach,
   found before training instead of one skipped step each. The model is left as it was found.

The suggested initial scale keeps the largest gradient `margin_bits` powers of two under 65504 (as
`advise` does). Imports only torch (the CLI's loading uses transformers and datasets).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..fp16.preflight import classifier_architecture, format_preflight, preflight_checkpoint
from .advise import add_advise_arguments, measured_options

__all__ = ["add_preflight_arguments", "check_options", "run"]

#: The options that are `preflight_checkpoint`'s keyword arguments (`--objective` resolved first).
MEASURED = ("train_file", "dataset_name", "dataset_config_name", "text_column_name", "block_size",
            "per_device_train_batch_size", "gradient_accumulation_steps", "steps", "near_bits", "margin_bits",
            "max_modules", "seed")  # fmt: skip


def add_preflight_arguments(parser: argparse.ArgumentParser) -> None:
    add_advise_arguments(parser)
    for action in parser._actions:  # same options as advise; preflight needs fewer batches
        if action.dest == "steps":
            action.default, action.help = 2, "Batches measured (each one forward + backward)."
    parser.add_argument("--near_bits", type=float, default=2.0,
                        help="Name modules whose activations come within this many bits of 65504.")  # fmt: skip
    parser.add_argument(
        "--max_modules", type=int, default=8, help="The most modules moved to FP32 in the replays."
    )


def check_options(opts: argparse.Namespace) -> None:
    """What can be refused before a model is loaded: the step count, the text file, the output path."""
    import os

    if opts.steps < 1:
        raise SystemExit(f"--steps {opts.steps}: preflight measures at least 1 batch.")
    if opts.train_file:
        try:
            with open(opts.train_file, encoding="utf-8", errors="replace") as f:
                has_text = any(line.strip() for line in f)
        except OSError as err:
            raise SystemExit(f"--train_file {opts.train_file}: {err.strerror}.") from None
        if not has_text:
            raise SystemExit(f"--train_file {opts.train_file} holds no text (empty, or blank lines only).")
    if opts.output_json:
        folder = os.path.dirname(os.path.abspath(opts.output_json))
        target = opts.output_json if os.path.exists(opts.output_json) else folder
        if not os.path.isdir(folder) or not os.access(target, os.W_OK):
            raise SystemExit(
                f"--output_json {opts.output_json}: cannot write there (checked before measuring)."
            )


def run(opts: argparse.Namespace) -> dict[str, Any]:
    """The command: check the options, measure, print the table with its verdict, write `--output_json`."""
    check_options(opts)
    # a sequence-classification checkpoint is measured as one, as run_glue.py loads it
    classifier = classifier_architecture(opts.model_name_or_path)
    objective = "cls" if classifier else opts.objective
    if classifier and opts.objective != "cls":
        print(
            f"{opts.model_name_or_path} is a sequence classifier ({classifier}): measured as one, with its own head."
        )
    try:
        result = preflight_checkpoint(
            opts.model_name_or_path, objective=objective, **measured_options(opts, MEASURED)
        )
    except ValueError as err:  # the text or the options: said as the command always said it
        raise SystemExit(str(err)) from None
    bs = opts.per_device_train_batch_size
    # preflight_checkpoint measures on the CPU, where the FP16 replays are emulated
    print(f"Pre-flight of {opts.model_name_or_path} ({objective}, {opts.steps} batches of {bs}x{opts.block_size} "
          "tokens; FP32 passes and FP16 emulated replays):")  # fmt: skip
    print(format_preflight(result))
    if opts.output_json:
        with open(opts.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
