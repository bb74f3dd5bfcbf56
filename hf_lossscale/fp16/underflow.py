"""The underflow map: which gradients FP16 throws away, and how that grows with the tokens per
optimizer step, measured without training (`underflow_map`; the command is `hf-lossscale underflow`,
`hf_lossscale.tools.underflow`).

For each point `MICRO x BLOCK x ACCUM` (micro-batch of MICRO sequences of BLOCK tokens, ACCUM
micro-batches per optimizer step; `/D` after it divides the loss by D more, which is the per-token
gradient scale of a step with D times more tokens), one optimizer step's gradient is computed twice on the same
batches: in FP32 (the reference, with this point's own loss divisor ACCUM: a reference made for one
divisor is not the reference for another) and in emulated FP16 (`fp16_emulation(policy="cuda")`,
each micro-batch its own backward, as accumulation does) at each scale: 1 (no loss scaling), the
largest power of two at which the step does not overflow (where dynamic scaling settles: it grows
until it overflows and backs off once), and a chosen static scale. Reported: the fraction of the
non-zero FP32 gradient elements that come out zero (overall, per module, and the LM head / word
embeddings apart from the rest) and the relative error `||g16 / scale - g32|| / ||g32||`.
Its table and figure are the command's (`hf_lossscale.tools.underflow`).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .emulation import accumulated_gradients, compare_gradients, fp16_emulation

__all__ = ["parse_point", "underflow_map", "load_for_objective", "DEFAULT_POINTS", "HEAD_PATTERN"]

DEFAULT_POINTS = "1x128x1 4x32x1 4x128x1 2x128x8 8x128x2 8x128x8 8x128x16"
#: Parameters of the LM head and the (tied) word embeddings: where the p/N gradients of the
#: non-target tokens land.
HEAD_PATTERN = re.compile(r"word_embeddings|lm_head|\.decoder\.|predictions\.bias|^cls\.|wte|embed_tokens")


def parse_point(text: str) -> tuple[int, int, int]:
    """`"8x128x16"` -> (8, 128, 16)."""
    return parse_divided_point(text)[:3]


def parse_divided_point(text: str) -> tuple[int, int, int, int]:
    """`"8x128x4/32"` -> (8, 128, 4, 32); without `/D`, D is 1."""
    text, _, divisor = text.partition("/")
    try:
        divisor = int(divisor or 1)
    except ValueError:
        raise ValueError(
            f"--points entry {text}/{divisor}: D in MICROxBLOCKxACCUM/D must be an integer."
        ) from None
    if divisor < 1 or divisor & (divisor - 1):
        raise ValueError(
            f"--points entry {text}/{divisor}: D must be a power of two (it divides the loss exactly)."
        )
    parts = text.lower().split("x")
    try:
        micro, block, accum = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--points entry {text!r}: expected MICROxBLOCKxACCUM, e.g. 8x128x16.") from None
    if min(micro, block, accum) < 1:
        raise ValueError(f"--points entry {text!r}: every factor must be at least 1.")
    return micro, block, accum, divisor


def _texts(objective: str, train_file: str | None) -> tuple[list[str], list[int] | None]:
    if train_file is None:
        from pydoc_data.topics import topics

        texts = [topics[k] for k in sorted(topics)]
        return texts, [i % 2 for i in range(len(texts))] if objective == "cls" else None
    path = Path(train_file)
    if not path.is_file():
        raise ValueError(f"--train_file {train_file!r} does not exist.")
    if objective != "cls":
        return [line for line in path.read_text().splitlines() if line.strip()], None
    import csv

    delimiter = "\t" if path.suffix == ".tsv" else ","
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter=delimiter, quoting=csv.QUOTE_NONE))
    if not rows or not {"sentence", "label"} <= set(rows[0]):
        raise ValueError(f"--train_file {train_file}: cls needs a header with `sentence` and `label`.")
    return [r["sentence"] for r in rows], [int(r["label"]) for r in rows]


def load_for_objective(model_name_or_path: str, objective: str, seed: int = 0):
    """`(tokenizer, model)` for "clm", "mlm" or "cls" (a fresh 2-label head), in FP32 eval mode; an
    encoder asked for "clm" becomes a decoder (`is_decoder`), as the recipes make it."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    config = AutoConfig.from_pretrained(model_name_or_path)
    if objective == "clm" and config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        config.is_decoder = True
    own_classifier = any(a.endswith("ForSequenceClassification") for a in (config.architectures or []))
    if objective == "cls" and not own_classifier:  # a fresh 2-label head; a classifier keeps its own
        config.num_labels = 2
    auto = {
        "clm": AutoModelForCausalLM,
        "mlm": AutoModelForMaskedLM,
        "cls": AutoModelForSequenceClassification,
    }
    model = auto[objective].from_pretrained(model_name_or_path, config=config).float().eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, model


class _Batches:
    """Micro-batches for each point, drawn in order from one token stream (LM) or sentence list (cls)."""

    def __init__(self, tokenizer, objective: str, train_file: str | None, seed: int) -> None:
        self.objective, self.tokenizer = objective, tokenizer
        texts, self.labels = _texts(objective, train_file)
        self.texts, self.ids, self.read = texts, [], 0
        self.generator = torch.Generator().manual_seed(seed)

    def micro_batches(self, micro: int, block: int, accum: int) -> tuple[list[dict[str, torch.Tensor]], int]:
        """ACCUM micro-batches and the number of input tokens they hold."""
        if self.objective == "cls":
            n = micro * accum
            rows = [(self.texts[i % len(self.texts)], self.labels[i % len(self.labels)]) for i in range(n)]
            batches, tokens = [], 0
            for k in range(accum):
                part = rows[k * micro : (k + 1) * micro]
                enc = self.tokenizer([t for t, _ in part], truncation=True, max_length=block, padding=True,
                                     return_tensors="pt")  # fmt: skip
                enc["labels"] = torch.tensor([y for _, y in part])
                tokens += int(enc["attention_mask"].sum())
                batches.append(dict(enc))
            return batches, tokens
        need = micro * block * accum
        while len(self.ids) < need and self.read < len(self.texts):  # tokenise only what is needed
            self.ids.extend(
                self.tokenizer(self.texts[self.read], add_special_tokens=False, verbose=False)["input_ids"]
            )
            self.read += 1
        if len(self.ids) < need:
            raise ValueError(
                f"Not enough text for {need:,} tokens ({len(self.ids):,} tokenised): pass a longer --train_file."
            )
        ids = torch.tensor(self.ids[:need]).view(accum, micro, block)
        batches = []
        for part in ids:
            if self.objective == "clm":
                batches.append({"input_ids": part, "labels": part.clone()})
            else:
                batches.append(self._mask(part))
        return batches, need

    def _mask(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """BERT's masking (15%: 80% [MASK], 10% random, 10% kept), from this map's own generator."""
        labels = ids.clone()
        chosen = torch.rand(ids.shape, generator=self.generator) < 0.15
        labels[~chosen] = -100
        inputs = ids.clone()
        roll = torch.rand(ids.shape, generator=self.generator)
        inputs[chosen & (roll < 0.8)] = self.tokenizer.mask_token_id
        random = chosen & (roll >= 0.8) & (roll < 0.9)
        inputs[random] = torch.randint(len(self.tokenizer), ids.shape, generator=self.generator)[random]
        return {"input_ids": inputs, "labels": labels}


def _loss(model, batch):
    return model(**batch).loss


def _groups(found: dict[str, Any]) -> dict[str, float]:
    """Flushed fraction of the LM head / word embeddings and of everything else."""
    sums = {"head": [0, 0], "rest": [0, 0]}
    for module, (lost, nonzero) in found["counts"].items():
        key = "head" if HEAD_PATTERN.search(module + ".") else "rest"
        sums[key][0] += lost
        sums[key][1] += nonzero
    return {k: (v[0] / v[1] if v[1] else None) for k, v in sums.items()}


def _measure(model, batches, divisor, reference, scale) -> dict[str, Any]:
    """`divisor` is the whole loss divisor (accumulation x D)."""
    low = accumulated_gradients(
        model, None, _loss, fp16_emulation("cuda"), scale / divisor, micro_batches=batches
    )
    found = compare_gradients(reference, low, scale)
    groups = _groups(found)
    return {
        "scale": scale,
        "flushed_fraction": found["flushed_fraction"],
        "flushed_head": groups["head"],
        "flushed_rest": groups["rest"],
        "relative_grad_error": found["relative_grad_error"],
        "overflow": found["overflow"],
        "per_module": found["per_module"],
    }


def _settled(model, batches, divisor, reference, max_scale, tried: dict[float, dict]) -> float:
    """The largest power of two <= max_scale at which the step does not overflow (searched by
    halving from the largest scale the scale-1 gradients allow, reusing measured scales)."""
    # Start where the average micro-batch's largest gradient reaches FP16's maximum (the summed
    # FP32 gradient may exceed 65504 without overflow: each micro-batch is FP16 on its own).
    amax = max(float(g.abs().max()) for g in reference.values()) / len(batches)
    k = min(math.floor(math.log2(max_scale)), math.floor(math.log2(65504.0 / max(amax, 1e-30))))
    while k > 0:
        scale = 2.0**k
        if scale not in tried:
            tried[scale] = _measure(model, batches, divisor, reference, scale)
        if not tried[scale]["overflow"]:
            return scale
        k -= 1
    return 1.0


def underflow_map(
    model_name_or_path: str,
    *,
    objective: str = "clm",
    train_file: str | None = None,
    points: str = DEFAULT_POINTS,
    static_scale: float = 2.0**24,
    max_scale: float = 2.0**24,
    seed: int = 0,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Measure every point of `points` (see the module docstring).

    Args:
        model_name_or_path (`str`): a local model folder (or a Hub id).
        objective (`str`, defaults to `"clm"`): `"clm"`, `"mlm"` or `"cls"` (a fresh 2-label head).
        train_file (`str`, *optional*): text (clm/mlm: one text per line; cls: a TSV/CSV with a header
            naming `sentence` and `label`); default: the Python documentation's topic pages.
        points (`str`): space- or comma-separated `MICROxBLOCKxACCUM[/D]` points.
        static_scale (`float`, defaults to 2^24): the static scale measured too.
        max_scale (`float`, defaults to 2^24): the largest scale the search for the settled one tries.
        seed (`int`, defaults to 0): the model's and the masking's seed.
        on_row (`Callable`, *optional*): called with each point's row as it is measured.

    Returns the map (`model`, `objective`, `data`, `static_scale`, `policy`, `rows`). Raises
    `ValueError` for a malformed point, missing or too little text.
    """
    parsed = [parse_divided_point(p) for p in re.split(r"[,\s]+", points.strip()) if p]
    if not parsed:
        raise ValueError("--points is empty.")
    tokenizer, model = load_for_objective(model_name_or_path, objective, seed)
    data = _Batches(tokenizer, objective, train_file, seed)
    rows = []
    for micro, block, accum, divisor in parsed:
        batches, tokens = data.micro_batches(micro, block, accum)
        total = accum * divisor
        reference = accumulated_gradients(
            model, None, _loss, contextlib.nullcontext(), 1.0 / total, micro_batches=batches
        )
        tried = {1.0: _measure(model, batches, total, reference, 1.0)}
        settled = _settled(model, batches, total, reference, max_scale, tried)
        if static_scale not in tried:
            tried[static_scale] = _measure(model, batches, total, reference, static_scale)
        rows.append({
            "point": f"{micro}x{block}x{accum}" + (f"/{divisor}" if divisor > 1 else ""),
            "micro_batch": micro, "block_size": block, "accumulation": accum, "loss_divisor": divisor,
            "tokens": tokens, "tokens_per_step": tokens * divisor, "settled_scale": settled,
            "at_1": tried[1.0], "at_settled": tried[settled], "at_static": tried[static_scale],
        })  # fmt: skip
        if on_row is not None:
            on_row(rows[-1])
    model.zero_grad(set_to_none=True)
    return {
        "model": model_name_or_path,
        "objective": objective,
        "data": train_file or "pydoc_data.topics (the Python documentation's topic pages)",
        "static_scale": static_scale,
        "policy": "cuda",
        "rows": rows,
    }
