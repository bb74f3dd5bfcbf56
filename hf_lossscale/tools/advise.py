"""`hf-lossscale advise`: what loss scale to use for a model and data, measured, not guessed.

Runs a few FP32 training steps on real batches (the loss divided by the accumulation count, as in
training), records the activation gradients at module boundaries (where FP16 underflow happens
under autocast) and the parameter gradients, and recommends the largest power of two that keeps
the largest gradient `--margin_bits` under FP16's maximum (65504), with the fraction of non-zero
activation-gradient elements that FP16 would flush to zero at scale 1 and at that scale.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from ..fp16.advise import advise

__all__ = ["add_advise_arguments", "measured_options", "format_advice", "run"]


def add_advise_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model_name_or_path", required=True, help="A local model folder or a Hub id.")
    parser.add_argument("--objective", choices=["mlm", "clm"], default="mlm", help="Masked or causal LM.")
    parser.add_argument("--train_file", default=None, help="Local text (txt: one text per line).")
    parser.add_argument("--dataset_name", default=None, help="A Hub data set with a text column.")
    parser.add_argument("--dataset_config_name", default=None)
    parser.add_argument("--text_column_name", default="text")
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=16,
                        help="The loss is divided by this, as gradient accumulation does.")  # fmt: skip
    parser.add_argument("--steps", type=int, default=4, help="FP32 steps measured (each one batch).")
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--margin_bits", type=int, default=3,
                        help="Keep the largest scaled gradient this many powers of two under 65504.")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_json", default=None, help="Also write the figures here.")


#: The options that are `advise`'s keyword arguments (the rest, `--output_json`, are the command's).
MEASURED = ("objective", "train_file", "dataset_name", "dataset_config_name", "text_column_name", "block_size",
            "per_device_train_batch_size", "gradient_accumulation_steps", "steps", "learning_rate",
            "margin_bits", "seed")  # fmt: skip


def measured_options(opts: argparse.Namespace, names: tuple[str, ...] = MEASURED) -> dict[str, Any]:
    """`names` of the parsed options, as keyword arguments."""
    return {name: getattr(opts, name) for name in names}


def format_advice(r: dict[str, Any]) -> str:
    """The command's text for `advise`'s figures: the recommendation and the most affected modules."""
    k = int(math.log2(r["recommended_scale"]))
    lines = [
        f"Measured {r['steps']} FP32 steps of {r['model']} ({r['objective']}, {r['tokens_per_step']} tokens per step, "
        f"loss / {r['loss_divisor']} as with gradient accumulation {r['loss_divisor']}).",
        f"Largest gradient: activations {r['activation_grad_max_abs']:.3g}, parameters {r['param_grad_max_abs']:.3g}.",
        f"Recommended initial (or static) scale: 2^{k} = {r['recommended_scale']:g} "
        f"(keeps the largest gradient {r['margin_bits']} powers of two under 65504).",
        f"Activation-gradient elements FP16 would flush to zero: {r['lost_at_1']:.2%} at scale 1, "
        f"{r['lost_at_recommended']:.2%} at 2^{k}.",
        f"Parameter-gradient elements below 2^-24: {r['param_lost_at_1']:.2%} at scale 1, "
        f"{r['param_lost_at_recommended']:.2%} at 2^{k}.",
        "",
        "Most affected modules at scale 1 (activation gradients, sampled):",
        f"| module | max abs grad | lost at 1 | lost at 2^{k} |",
        "|---|---|---|---|",
    ]
    for name, m in list(r["per_module"].items())[:8]:
        lines.append(
            f"| {name} | {m['max_abs']:.3g} | {m['lost_at_1']:.2%} | {m['lost_at_recommended']:.2%} |"
        )
    lines += ["", f"Use: --loss_scale_init {r['recommended_scale']:g}  (or --loss_scale_mode static --loss_scale_init "
              f"{r['recommended_scale']:g})"]  # fmt: skip
    return "\n".join(lines)


def run(opts: argparse.Namespace) -> dict[str, Any]:
    """The command: measure, print the advice, write `--output_json`."""
    try:
        result = advise(opts.model_name_or_path, **measured_options(opts))
    except ValueError as err:  # the text or the options: said as the command always said it
        raise SystemExit(str(err)) from None
    print(format_advice(result))
    if opts.output_json:
        with open(opts.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
