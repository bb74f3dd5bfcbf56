"""Will this checkpoint train in FP16? Checked before the first step (`preflight` on any model and
batches, `preflight_checkpoint` on a saved checkpoint and text; the command is `hf-lossscale
preflight`, `hf_lossscale.tools.preflight`).

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
`advise` does). Imports only torch (`preflight_checkpoint`'s loading uses transformers and datasets).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch

from ..core.module_hooks import ModuleHooks
from ..core.overflow import find_overflow_origin, floating_tensors
from ..core.telemetry import FP16_MAX
from .advise import FP16_TINY, recommended_scale
from .fp32_modules import run_in_fp32, runs_in_fp32, unwrap

__all__ = ["preflight", "format_preflight", "classifier_architecture", "preflight_checkpoint"]


def _bits(ratio: float) -> float | None:
    return math.log2(ratio) if ratio > 0 and math.isfinite(ratio) else None


def _fp32_stats(model, batches, loss_fn, loss_divisor) -> tuple[dict[str, dict[str, float]], list[float]]:
    stats: dict[str, dict[str, float]] = {}

    def record_grad(name):
        def hook(grad):
            g = grad.detach().abs()
            s = stats[name]
            s["grad_max"] = max(s["grad_max"], float(g.max()))
            nz = g[g > 0]
            if nz.numel():
                s["grad_min"] = min(s["grad_min"], float(nz.min()))

        return hook

    def after_forward(name, module, args, output):
        s = stats.setdefault(
            name, {"act_max": 0.0, "grad_max": 0.0, "grad_min": math.inf, "type": type(module).__name__}
        )
        for t in floating_tensors(output):
            if t.numel():
                s["act_max"] = max(s["act_max"], float(t.detach().abs().max()))
            if t.requires_grad:
                t.register_hook(record_grad(name))

    losses = []
    params = [p for p in model.parameters() if p.requires_grad]
    with ModuleHooks(model, forward=after_forward, where=bool):  # every submodule, not the model itself
        for batch in batches:
            loss = loss_fn(model, batch)
            losses.append(float(loss.detach()))
            torch.autograd.grad(loss / loss_divisor, params, allow_unused=True)
    return stats, losses


def preflight(
    model: torch.nn.Module,
    batches: list[Any],
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    *,
    fp16_context: Callable[[], contextlib.AbstractContextManager] | None = None,
    loss_divisor: float = 1.0,
    near_bits: float = 2.0,
    margin_bits: int = 3,
    max_modules: int = 8,
) -> dict[str, Any]:
    """The pre-flight figures for `model` on `batches` (see the module docstring).

    `loss_fn(model, batch)` returns the training loss; `loss_divisor` divides it as gradient
    accumulation does. `fp16_context` is the FP16 compute (default: `fp16_emulation()` on the CPU,
    `torch.autocast("cuda", float16)` on CUDA). Returns a dict: `modules` (per module: `act_max`,
    `act_margin_bits`, `grad_max`, `grad_min`, `grad_top_margin_bits`, `grad_bottom_margin_bits`,
    `status` in `overflows` / `near` / `ok`), `overflow_in_fp16` (the origins found by the FP16
    replays, in order), `suggested_fp32_modules` (those origins without the ones inside another),
    `suggested_init_scale`, `losses`.
    """
    if fp16_context is None:
        device = next(model.parameters()).device
        if device.type == "cuda":
            fp16_context = lambda: torch.autocast("cuda", dtype=torch.float16)  # noqa: E731
        else:
            from .emulation import fp16_emulation

            fp16_context = fp16_emulation
    was_training = model.training
    try:
        model.eval()  # no dropout: the figures describe the function, and no random number is drawn
        stats, losses = _fp32_stats(model, batches, loss_fn, loss_divisor)
        # the replays run as training does (dropout included: with it an inf reaches the loss where an
        # eval-mode kernel may mask it), from a forked RNG
        model.train()
        origins = _fp16_origins(model, batches, loss_fn, fp16_context, max_modules)
    finally:
        model.train(was_training)
    modules = {}
    for name, s in stats.items():
        act_bits = _bits(FP16_MAX / s["act_max"]) if s["act_max"] > 0 else None
        top = _bits(FP16_MAX / s["grad_max"]) if s["grad_max"] > 0 else None
        bottom = _bits(s["grad_min"] / FP16_TINY) if math.isfinite(s["grad_min"]) else None
        status = "ok"
        if s["act_max"] > FP16_MAX:
            status = "overflows"
        elif act_bits is not None and act_bits < near_bits:
            status = "near"
        modules[name] = {
            "type": s["type"],
            "act_max": s["act_max"],
            "act_margin_bits": act_bits,
            "grad_max": s["grad_max"],
            "grad_min": s["grad_min"] if math.isfinite(s["grad_min"]) else None,
            "grad_top_margin_bits": top,
            "grad_bottom_margin_bits": bottom,
            "status": status,
        }
    grad_max = max((m["grad_max"] for m in modules.values()), default=0.0)
    init_scale = recommended_scale(grad_max, margin_bits)
    return {
        "losses": losses,
        "near_bits": near_bits,
        "margin_bits": margin_bits,
        "modules": modules,
        "overflow_in_fp16": origins,
        # a forward overflow no module move fixes: it starts in the model's own forward (outside its
        # submodules) or in the loss (origin "")
        "overflow_outside_modules": any(not o.get("origin") for o in origins),
        "suggested_fp32_modules": _outermost([o["origin"] for o in origins if o.get("origin")]),
        "suggested_init_scale": init_scale,
        "grad_max": grad_max,
    }


def _outermost(names: list[str]) -> list[str]:
    """`names` without those inside another of them (a module in FP32 runs its children in FP32)."""
    return [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]


def _fp16_origins(model, batches, loss_fn, context, max_modules) -> list[dict[str, Any]]:
    """Replay in FP16, moving each forward-overflow origin to FP32, until none overflows forward;
    then undo the moves (the model is left as it was found)."""
    added: list[torch.nn.Module] = []
    origins: list[dict[str, Any]] = []
    named = dict(model.named_modules())
    try:
        for _ in range(max_modules + 1):
            found = find_overflow_origin(model, batches, loss_fn, context=context, scale=1.0)
            if found is None or found["kind"] != "forward":
                break
            origins.append(found)
            name = found.get("origin")
            if not name or len(origins) > max_modules:
                break
            if not runs_in_fp32(named[name]):
                run_in_fp32(model, [name], include_model_own=False)
                added.append(named[name])
    finally:
        for module in added:
            unwrap(module)
    return origins


def format_preflight(r: dict[str, Any], rows: int = 12) -> str:
    """The pre-flight table (Markdown): overflowing and near modules first, then the tightest."""

    def bits(v):
        return "-" if v is None else f"{v:+.1f}"

    order = sorted(
        r["modules"].items(),
        key=lambda kv: kv[1]["act_margin_bits"] if kv[1]["act_margin_bits"] is not None else math.inf,
    )
    shown = [kv for kv in order if kv[1]["status"] != "ok"] or []
    shown += [kv for kv in order if kv[1]["status"] == "ok"][: max(0, rows - len(shown))]
    lines = [
        "| module | type | activation absmax | margin to 65504 (bits) | grad max | grad min (non-zero) | "
        "grad margin top / bottom (bits, scale 1) | FP16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in shown:
        grad_min = "-" if m["grad_min"] is None else f"{m['grad_min']:.3g}"
        lines.append(
            f"| {name} | {m['type']} | {m['act_max']:.4g} | {bits(m['act_margin_bits'])} | {m['grad_max']:.3g} | "
            f"{grad_min} | {bits(m['grad_top_margin_bits'])} / {bits(m['grad_bottom_margin_bits'])} | {m['status']} |"
        )
    over = [n for n, m in r["modules"].items() if m["status"] == "overflows"]
    near = [n for n, m in r["modules"].items() if m["status"] == "near"]
    k = int(math.log2(r["suggested_init_scale"]))
    origins = ", ".join(
        f"`{o['origin']}` ({o['module_type']})" for o in r["overflow_in_fp16"] if o.get("origin")
    )
    if over or origins or r.get("overflow_outside_modules"):
        verdict = "FP16 overflows in this model's forward: move the modules below to FP32 (or 'auto')."
    elif near:
        verdict = (
            f"FP16 runs, but {len(near)} module(s) come within {r['near_bits']:g} bits of 65504: watch them."
        )
    else:
        verdict = f"clean: FP16 runs this model as it is; start the scale at 2^{k}."
    lines += [
        "",
        f"**Verdict: {verdict}**",
        "",
        f"- Activations above 65504 in FP32: {len(over)} module(s){': ' + ', '.join(over) if over else ''}.",
        f"- Within {r['near_bits']:g} bits of 65504: {len(near)} module(s){': ' + ', '.join(near) if near else ''}.",
        "- FP16 forward (replayed, moving each origin to FP32 in turn): "
        + (f"overflows, starting in {origins}." if origins else "" if r.get("overflow_outside_modules") else "no overflow.")
        + (" Overflows in the model's own forward (outside its submodules) or in the loss: no module to move "
           "to FP32 fixes it; compute the loss in FP32 or lower the logits' range." if r.get("overflow_outside_modules") else ""),
        f"- Suggested fp32_modules: {r['suggested_fp32_modules'] or 'none'}"
        + (f"  (--loss_scale_fp32_modules {','.join(r['suggested_fp32_modules'])}, or 'auto')" if r["suggested_fp32_modules"] else ""),
        f"- Suggested initial scale: 2^{k} = {r['suggested_init_scale']:g} (largest gradient {r['grad_max']:.3g}, "
        f"{r['margin_bits']} bits under 65504)",
    ]  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------------- a saved checkpoint
def classifier_architecture(model_name_or_path: str) -> str | None:
    """The checkpoint's sequence-classifier architecture (`BertForSequenceClassification`, ...), or
    None: such a checkpoint is measured as what it was saved for, as `run_glue.py` loads it (objective
    `"cls"`, its own head and labels)."""
    from transformers import AutoConfig

    archs = getattr(AutoConfig.from_pretrained(model_name_or_path), "architectures", None) or []
    return next((a for a in archs if a.endswith("ForSequenceClassification")), None)


def preflight_checkpoint(
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
    steps: int = 2,
    near_bits: float = 2.0,
    margin_bits: int = 3,
    max_modules: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """`preflight` on a saved checkpoint, on the CPU (FP16 emulated), with `steps` batches of
    `per_device_train_batch_size` blocks of `block_size` tokens from `train_file` (or `dataset_name`):
    `objective` `"mlm"` (masked, BERT's collator), `"clm"` (causal) or `"cls"` (labels alternating over
    the checkpoint's classes; see `classifier_architecture`). The loss is divided by
    `gradient_accumulation_steps`. Returns `preflight`'s figures with `model`; raises `ValueError` for
    unusable text (`advise.load_blocks`)."""
    from transformers import DataCollatorForLanguageModeling

    from .advise import load_blocks
    from .underflow import load_for_objective

    tokenizer, model = load_for_objective(model_name_or_path, objective, seed)
    bs = per_device_train_batch_size
    blocks = load_blocks(
        tokenizer, train_file=train_file, dataset_name=dataset_name, dataset_config_name=dataset_config_name,
        text_column_name=text_column_name, block_size=block_size, batch_size=bs, steps=steps,
    )  # fmt: skip
    collator = (
        DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15) if objective == "mlm" else None
    )
    torch.manual_seed(seed)
    batches = []
    for step in range(steps):
        chunk = blocks[(step * bs) % len(blocks) : (step * bs) % len(blocks) + bs]
        if collator is not None:
            batches.append(dict(collator([{"input_ids": c} for c in chunk])))
        elif objective == "cls":  # labels alternate over the checkpoint's own classes, as the underflow map's
            labels = torch.arange(step * bs, step * bs + len(chunk)) % model.config.num_labels
            batches.append({"input_ids": torch.tensor(chunk), "labels": labels})
        else:
            ids = torch.tensor(chunk)
            batches.append({"input_ids": ids, "labels": ids.clone()})

    def loss_fn(m, batch):
        return m(**batch).loss

    result = preflight(
        model, batches, loss_fn, loss_divisor=gradient_accumulation_steps, near_bits=near_bits,
        margin_bits=margin_bits, max_modules=max_modules,
    )  # fmt: skip
    result["model"] = model_name_or_path
    return result
