"""A skipped step at 60,000 parameter tensors, names resolved, against torch's `GradScaler` step.

Naming the overflowing parameters used to scan the optimizer's list once per tensor (quadratic: 69 s
at 60,000 tensors against torch's 0.11 s). Here: 60,000 small tensors, SGD (foreach), one inf in the
last gradient; the median of `--repeats` skipped steps (scale + unscale + check + step + update, then
`overflow_params`), ratios against torch's `GradScaler` in the same process, and naming alone.

    python benchmarks/many_tensors.py [--tensors 60000 --repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hf_lossscale import DynamicLossScaler

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tensors", type=int, default=60000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "many_tensors.json"))
    opts = parser.parse_args(argv)
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(opts.tensors)]
    opt = torch.optim.SGD(params, lr=0.1)

    def skipped_step(scaler) -> float:
        loss = torch.ones((), requires_grad=True)
        scaler.scale(loss)
        for p in params:
            p.grad = torch.ones(4)
        params[-1].grad[0] = float("inf")
        start = time.perf_counter()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        if isinstance(scaler, DynamicLossScaler):
            assert scaler.overflow_params == [f"param_groups[0].params[{opts.tensors - 1}] (shape (4,))"]
        return time.perf_counter() - start

    times = {"torch GradScaler": [], "DynamicLossScaler (names resolved)": []}
    ours = DynamicLossScaler(init_scale=2.0**16, max_consecutive_skips=None, telemetry_interval=0)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for _ in range(opts.repeats):
        times["torch GradScaler"].append(skipped_step(theirs))
        times["DynamicLossScaler (names resolved)"].append(skipped_step(ours))
    base = statistics.median(times["torch GradScaler"])
    rows = {name: {"median_s": statistics.median(v), "ratio": statistics.median(v) / base,
                   "spread": (max(v) - min(v)) / statistics.median(v)} for name, v in times.items()}  # fmt: skip
    lines = [f"A skipped step at {opts.tensors:,} tensors (median of {opts.repeats}):"]
    lines += [f"  {name:<38} {r['median_s'] * 1e3:8.1f} ms  x{r['ratio']:.2f}  (spread {r['spread']:.0%})"
              for name, r in rows.items()]  # fmt: skip
    print("\n".join(lines))
    result = {"tensors": opts.tensors, "repeats": opts.repeats, "rows": rows}
    Path(opts.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
