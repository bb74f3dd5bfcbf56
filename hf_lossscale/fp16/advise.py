"""What loss scale to use for a model and data, measured, not guessed (`advise`; the command is
`hf-lossscale advise`, `hf_lossscale.tools.advise`).

Runs a few FP32 training steps on real batches (the loss divided by the accumulation count, as in
training), records the activation gradients at module boundaries (where FP16 underflow happens
under autocast) and the parameter gradients, and recommends the largest power of two that keeps
the largest gradient `margin_bits` under FP16's maximum (65504), with the fraction of non-zero
activation-gradient elements that FP16 would flush to zero at scale 1 and at that scale.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..core.telemetry import FP16_MAX, ActivationGradientProbe

__all__ = ["advise", "load_blocks", "recommended_scale", "FP16_TINY"]

FP16_TINY = 2.0**-24


def load_blocks(
    tokenizer: Any,
    *,
    train_file: str | None = None,
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    text_column_name: str = "text",
    block_size: int = 128,
    batch_size: int = 4,
    steps: int = 4,
) -> list[list[int]]:
    """Blocks of `block_size` token ids from a local text file (one text per line) or a data set's
    text column: enough for `steps` batches of `batch_size` (at least one batch). Raises
    `ValueError` for neither or both sources, a missing column, or too little text."""
    from .._extras import need

    load_dataset = need("datasets", "Reading a text data set", "tools").load_dataset

    if (train_file is None) == (dataset_name is None):
        raise ValueError("Give exactly one of --train_file or --dataset_name.")
    if train_file:
        raw = load_dataset("text", data_files={"train": train_file})["train"]
    else:
        raw = load_dataset(dataset_name, dataset_config_name, split="train")
    if text_column_name not in raw.column_names:
        raise ValueError(
            f"No text column {text_column_name!r} in {raw.column_names}: pass --text_column_name."
        )
    needed = steps * batch_size * block_size
    ids: list[int] = []
    for text in raw[text_column_name]:
        if text and text.strip():
            ids.extend(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        if len(ids) >= needed:
            break
    n = len(ids) // block_size
    if n < batch_size:
        raise ValueError(f"Not enough text for {batch_size} blocks of {block_size} tokens.")
    return [ids[i * block_size : (i + 1) * block_size] for i in range(n)]


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


def advise(
    model_name_or_path: str,
    *,
    objective: str = "mlm",
    train_file: str | None = None,
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    text_column_name: str = "text",
    block_size: int = 128,
    per_device_train_batch_size: int = 4,
    gradient_accumulation_steps: int = 16,
    steps: int = 4,
    learning_rate: float = 5e-5,
    margin_bits: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """Measure `steps` FP32 steps of `model_name_or_path` and recommend a loss scale.

    Args:
        model_name_or_path (`str`): a local model folder or a Hub id.
        objective (`str`, defaults to `"mlm"`): `"mlm"` (masked) or `"clm"` (causal).
        train_file (`str`, *optional*): local text, one text per line; or `dataset_name`
            (`dataset_config_name`, `text_column_name`): a data set with a text column. Exactly one.
        block_size (`int`, defaults to 128): tokens per sequence.
        per_device_train_batch_size (`int`, defaults to 4): sequences per step.
        gradient_accumulation_steps (`int`, defaults to 16): the loss is divided by this, as
            accumulation does.
        steps (`int`, defaults to 4): FP32 steps measured (each one batch).
        learning_rate (`float`, defaults to 5e-5): AdamW's, between the steps.
        margin_bits (`int`, defaults to 3): keep the largest scaled gradient this many powers of two
            under 65504.
        seed (`int`, defaults to 0): the model's seed.

    Returns the figures (`recommended_scale`, the largest gradients, the flushed fractions at scale
    1 and at the recommendation, per module).
    Raises `ValueError` for unusable text (see `load_blocks`).
    """
    from transformers import DataCollatorForLanguageModeling

    from .underflow import load_for_objective

    causal = objective == "clm"
    tokenizer, model = load_for_objective(model_name_or_path, objective, seed)
    model.train()
    blocks = load_blocks(
        tokenizer, train_file=train_file, dataset_name=dataset_name, dataset_config_name=dataset_config_name,
        text_column_name=text_column_name, block_size=block_size, batch_size=per_device_train_batch_size,
        steps=steps,
    )  # fmt: skip
    collator = None if causal else DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    samples: dict[str, list[torch.Tensor]] = {}

    def keep_sample(name: str, grad: torch.Tensor) -> None:  # FP32 samples, read after the run
        samples.setdefault(name, []).append(
            grad.detach().reshape(-1)[:: max(1, grad.numel() // 4096)].float().cpu()
        )

    probe = ActivationGradientProbe(model, sample=4096, on_gradient=keep_sample)
    probe.active = True
    param_amax, param_samples, losses = 0.0, [], []
    bs = per_device_train_batch_size
    for step in range(steps):
        chunk = blocks[(step * bs) % len(blocks) : (step * bs) % len(blocks) + bs]
        if causal:
            ids = torch.tensor(chunk)
            batch = {"input_ids": ids, "labels": ids.clone()}
        else:
            batch = collator([{"input_ids": c} for c in chunk])
        loss = model(**batch).loss
        losses.append(float(loss.detach()))
        (loss / gradient_accumulation_steps).backward()
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
    recommended = recommended_scale(amax, margin_bits)
    per_module = {
        name: {
            "max_abs": max(float(s.abs().max()) for s in v),
            "lost_at_1": _lost(v, 1.0),
            "lost_at_recommended": _lost(v, recommended),
        }
        for name, v in samples.items()
    }
    result = {
        "model": model_name_or_path,
        "objective": objective,
        "steps": steps,
        "tokens_per_step": bs * block_size,
        "loss_divisor": gradient_accumulation_steps,
        "losses": losses,
        "activation_grad_max_abs": act_amax,
        "param_grad_max_abs": param_amax,
        "margin_bits": margin_bits,
        "recommended_scale": recommended,
        "lost_at_1": _lost(flat, 1.0),
        "lost_at_recommended": _lost(flat, recommended),
        "param_lost_at_1": _lost(param_samples, 1.0),
        "param_lost_at_recommended": _lost(param_samples, recommended),
        "per_module": dict(sorted(per_module.items(), key=lambda kv: -kv[1]["lost_at_1"])),
        "modules_measured": sorted(samples),
    }
    return result
