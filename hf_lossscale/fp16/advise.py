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

import torch

from ..core.telemetry import FP16_MAX, ActivationGradientProbe

__all__ = ["add_advise_arguments", "advise", "recommended_scale", "FP16_TINY"]

FP16_TINY = 2.0**-24


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


def load_blocks(opts: argparse.Namespace, tokenizer) -> list[list[int]]:
    from .._extras import need

    load_dataset = need("datasets", "Reading a text data set", "tools").load_dataset

    if (opts.train_file is None) == (opts.dataset_name is None):
        raise SystemExit("Give exactly one of --train_file or --dataset_name.")
    if opts.train_file:
        raw = load_dataset("text", data_files={"train": opts.train_file})["train"]
    else:
        raw = load_dataset(opts.dataset_name, opts.dataset_config_name, split="train")
    if opts.text_column_name not in raw.column_names:
        raise SystemExit(
            f"No text column {opts.text_column_name!r} in {raw.column_names}: pass --text_column_name."
        )
    needed = opts.steps * opts.per_device_train_batch_size * opts.block_size
    ids: list[int] = []
    for text in raw[opts.text_column_name]:
        if text and text.strip():
            ids.extend(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        if len(ids) >= needed:
            break
    n = len(ids) // opts.block_size
    if n < opts.per_device_train_batch_size:
        raise SystemExit(
            f"Not enough text for {opts.per_device_train_batch_size} blocks of {opts.block_size} tokens."
        )
    return [ids[i * opts.block_size : (i + 1) * opts.block_size] for i in range(n)]


def recommended_scale(amax: float, margin_bits: int) -> float:
    """The largest power of two (in [1, 2^24]) that keeps a gradient of `amax` `margin_bits` powers of
    two under 65504; 2^16 when every gradient is zero."""
    if amax <= 0:
        return 2.0**16
    exponent = math.floor(math.log2(FP16_MAX / amax)) - margin_bits
    return 2.0 ** min(max(exponent, 0), 24)


def _lost(samples: list[torch.Tensor], scale: float) -> float:
    """Fraction of the non-zero sampled elements that FP16 flushes to zero at `scale`."""
    nonzero = lost = 0
    for s in samples:
        a = s.abs()
        nz = a > 0
        nonzero += int(nz.sum())
        lost += int((nz & (a * scale < FP16_TINY)).sum())
    return lost / max(nonzero, 1)


def advise(opts: argparse.Namespace) -> dict[str, Any]:
    from transformers import DataCollatorForLanguageModeling

    from .underflow import load_for_objective

    causal = opts.objective == "clm"
    tokenizer, model = load_for_objective(opts.model_name_or_path, opts.objective, opts.seed)
    model.train()
    blocks = load_blocks(opts, tokenizer)
    collator = None if causal else DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.learning_rate)
    samples: dict[str, list[torch.Tensor]] = {}

    def keep_sample(name: str, grad: torch.Tensor) -> None:  # FP32 samples, read after the run
        samples.setdefault(name, []).append(
            grad.detach().reshape(-1)[:: max(1, grad.numel() // 4096)].float().cpu()
        )

    probe = ActivationGradientProbe(model, sample=4096, on_gradient=keep_sample)
    probe.active = True
    param_amax, param_samples, losses = 0.0, [], []
    bs = opts.per_device_train_batch_size
    for step in range(opts.steps):
        chunk = blocks[(step * bs) % len(blocks) : (step * bs) % len(blocks) + bs]
        if causal:
            ids = torch.tensor(chunk)
            batch = {"input_ids": ids, "labels": ids.clone()}
        else:
            batch = collator([{"input_ids": c} for c in chunk])
        loss = model(**batch).loss
        losses.append(float(loss.detach()))
        (loss / opts.gradient_accumulation_steps).backward()
        for _, p in model.named_parameters():
            if p.grad is not None:
                g = p.grad.detach()
                param_amax = max(param_amax, float(g.abs().max()))
                param_samples.append(g.reshape(-1)[:: max(1, g.numel() // 4096)].clone())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    probe.remove()
    flat = [s for v in samples.values() for s in v]
    act_amax = max((float(s.abs().max()) for s in flat if s.numel()), default=0.0)
    amax = max(act_amax, param_amax)
    recommended = recommended_scale(amax, opts.margin_bits)
    per_module = {
        name: {
            "max_abs": max(float(s.abs().max()) for s in v),
            "lost_at_1": _lost(v, 1.0),
            "lost_at_recommended": _lost(v, recommended),
        }
        for name, v in samples.items()
    }
    result = {
        "model": opts.model_name_or_path,
        "objective": opts.objective,
        "steps": opts.steps,
        "tokens_per_step": bs * opts.block_size,
        "loss_divisor": opts.gradient_accumulation_steps,
        "losses": losses,
        "activation_grad_max_abs": act_amax,
        "param_grad_max_abs": param_amax,
        "margin_bits": opts.margin_bits,
        "recommended_scale": recommended,
        "lost_at_1": _lost(flat, 1.0),
        "lost_at_recommended": _lost(flat, recommended),
        "param_lost_at_1": _lost(param_samples, 1.0),
        "param_lost_at_recommended": _lost(param_samples, recommended),
        "per_module": dict(sorted(per_module.items(), key=lambda kv: -kv[1]["lost_at_1"])),
        "modules_measured": sorted(samples),
    }
    return result


def format_advice(r: dict[str, Any]) -> str:
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
    result = advise(opts)
    print(format_advice(result))
    if opts.output_json:
        with open(opts.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
