"""The masters' optimizer step against FP32 weights' step with the same optimizer, in one process.

Two models of the same shape (an MLP of `--width`-square layers, one thread): FP32 weights, and FP16
weights on FP32 masters (`DynamicLossScaler`, `master_weights=True`). Each repeat gives both the same
gradients (FP16 ones for the masters, as a backward leaves them) and times `scaler.step(opt)` +
`scaler.update()` on each, in alternating order; the figure is the median of the per-repeat ratios,
with their spread (min, max) as the noise. Optimizers: AdamW fused, AdamW foreach, SGD with momentum
(foreach). Where the time goes on the masters' side is printed with `--profile` (per aten op).

    python benchmarks/master_step_ratio.py [--width 4096] [--repeats 9] [--device cuda] [--json OUT]
    python benchmarks/master_step_ratio.py --chunked-arm   # also the step without the CPU kernel
    python benchmarks/master_step_ratio.py --width 1024 --bucket 65536 524288   # the chunked update's bucket

On a CPU the masters' fused AdamW and SGD steps run `masters/cpu_kernel.py` where it builds (one pass);
`--chunked-arm` times the chunked update beside it (the kernel set aside), whose bucket `--bucket` sets.

Ctrl-C or SIGTERM stops it; the JSON is written at the end, atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

import torch

OPTIMIZERS = {
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-5, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-5, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True),
}


def _side(dtype: torch.dtype, width: int, layers: int, optimizer: str, device: str = "cpu"):
    from hf_lossscale import DynamicLossScaler, LossScaleConfig

    torch.manual_seed(0)
    layers_ = [torch.nn.Linear(width, width, bias=False) for _ in range(layers)]
    model = torch.nn.Sequential(*layers_).to(device=device, dtype=dtype)
    params = list(model.parameters())
    opt = OPTIMIZERS[optimizer](params)
    scaler = DynamicLossScaler(config=LossScaleConfig(init_scale=2.0**10, master_weights=True))
    return params, opt, scaler


def _timed_step(params, opt, scaler, grads) -> float:
    for p, g in zip(params, grads, strict=True):
        # what a backward leaves (outside the timing): a copy, since a fused optimizer handed the
        # scaler's grad_scale writes the unscaled gradient back (a shared tensor would shrink step by step
        # into FP32 subnormals, whose arithmetic is many times slower on a CPU)
        p.grad = g.to(p.dtype, copy=True)
    scaler.scale(torch.ones((), device=params[0].device))  # the iteration's scale (as before a backward)
    cuda = params[0].device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    scaler.step(opt)
    scaler.update()
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    opt.zero_grad()
    return elapsed


def _chunked_step(params, opt, scaler, grads) -> float:
    """The masters' step with the CPU kernel (`masters/cpu_kernel.py`) set aside: the chunked update of
    `masters/step.py`, the path before 2026-12-07 and where the kernel cannot build: the A/B of the
    kernel, in the same process."""
    from hf_lossscale.masters import cpu_kernel

    kernel = cpu_kernel.reason
    cpu_kernel.reason = lambda: "set aside by --chunked-arm"
    try:
        return _timed_step(params, opt, scaler, grads)
    finally:
        cpu_kernel.reason = kernel


def measure(
    optimizer: str, width: int, layers: int, repeats: int, device: str = "cpu", chunked: bool = False
) -> dict:
    fp32 = _side(torch.float32, width, layers, optimizer, device)
    masters = _side(torch.float16, width, layers, optimizer, device)
    gen = torch.Generator().manual_seed(1)
    grads = [
        (torch.randn(p.shape, generator=gen) * 2.0**-4).to(device) for p in fp32[0]
    ]  # scaled, FP16-representable
    for side in (fp32, masters):  # the first step makes the state (and the masters): not timed
        _timed_step(*side, grads)
    # each repeat: FP32, masters (and, with `chunked`, FP32 again and the masters' chunked update),
    # forwards on even repeats and backwards on odd ones; each masters time over its neighbouring FP32 one
    arms = [(_timed_step, fp32), (_timed_step, masters)]
    if chunked:
        arms += [(_timed_step, fp32), (_chunked_step, masters)]
    times: list[list[float]] = [[] for _ in arms]
    for i in range(repeats):
        for k in range(len(arms)) if i % 2 == 0 else reversed(range(len(arms))):
            run, side = arms[k]
            times[k].append(run(*side, grads))
    ratios = [b / a for a, b in zip(times[0], times[1], strict=True)]
    row = {
        "optimizer": optimizer, "parameters": sum(p.numel() for p in fp32[0]), "repeats": repeats,
        "fp32_ms": 1e3 * statistics.median(times[0]), "masters_ms": 1e3 * statistics.median(times[1]),
        "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "ratio_quartiles": _quartiles(ratios),
        "skipped": masters[2].stats()["skipped_steps"] + fp32[2].stats()["skipped_steps"],
    }  # fmt: skip
    if chunked:
        old = [b / a for a, b in zip(times[2], times[3], strict=True)]
        row["chunked"] = {
            "masters_ms": 1e3 * statistics.median(times[3]), "ratio": statistics.median(old),
            "ratio_min": min(old), "ratio_max": max(old), "ratio_quartiles": _quartiles(old),
        }  # fmt: skip
    return row


def _quartiles(values: list[float]) -> list[float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return [q[0], q[2]]


def profile(optimizer: str, width: int, layers: int) -> str:
    from torch.profiler import profile as _profile

    side = _side(torch.float16, width, layers, optimizer)
    grads = [torch.randn(p.shape) * 2.0**-4 for p in side[0]]
    _timed_step(*side, grads)
    for p, g in zip(side[0], grads, strict=True):
        p.grad = g.half()
    side[2].scale(torch.ones(()))
    with _profile() as prof:
        side[2].step(side[1])
        side[2].update()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--optimizers", nargs="+", default=sorted(OPTIMIZERS), choices=sorted(OPTIMIZERS))
    ap.add_argument("--device", default="cpu", help="cpu (one thread) or cuda")
    ap.add_argument("--profile", action="store_true", help="the masters' step per aten op, per optimizer")
    ap.add_argument(
        "--bucket",
        type=int,
        nargs="+",
        metavar="ELEMENTS",
        help="the chunked update's bucket, fixed to each of these sizes in turn (default: the package's rule)",
    )
    ap.add_argument(
        "--chunked-arm",
        action="store_true",
        help="on a CPU: also time the masters' step with the CPU kernel set aside (the chunked update)",
    )
    ap.add_argument("--json", help="write the rows here (atomically)")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.device == "cpu":
        torch.set_num_threads(1)
    from hf_lossscale.masters import step as chunked

    rows = []
    rule = chunked.UPDATE_BUCKET
    try:
        for bucket, name in [(b, n) for b in args.bucket or [None] for n in args.optimizers]:
            chunked.UPDATE_BUCKET = rule if bucket is None else (bucket, bucket)
            chunked_arm = args.chunked_arm and args.device == "cpu"
            row = measure(name, args.width, args.layers, args.repeats, args.device, chunked_arm)
            row["bucket"] = bucket
            rows.append(row)
            where = "" if bucket is None else f" bucket {bucket}"
            q1, q3 = row["ratio_quartiles"]
            print(f"{name:14s} {row['parameters'] / 1e6:.1f}M params{where}: FP32 weights {row['fp32_ms']:.1f} ms, "
                  f"masters {row['masters_ms']:.1f} ms, x{row['ratio']:.2f} (quartiles x{q1:.2f}..x{q3:.2f}, "
                  f"per repeat x{row['ratio_min']:.2f}..x{row['ratio_max']:.2f}, {row['repeats']} repeats)",
                  flush=True)  # fmt: skip
            if chunked_arm:
                old = row["chunked"]
                q1, q3 = old["ratio_quartiles"]
                print(f"{'':14s} the chunked update (no CPU kernel): masters {old['masters_ms']:.1f} ms, "
                      f"x{old['ratio']:.2f} (quartiles x{q1:.2f}..x{q3:.2f}, per repeat x{old['ratio_min']:.2f}.."
                      f"x{old['ratio_max']:.2f})", flush=True)  # fmt: skip
            if args.profile:
                print(profile(name, args.width, args.layers))
    finally:
        chunked.UPDATE_BUCKET = rule  # the package's rule again, for whatever runs next in this process
    if args.json:
        tmp = f"{args.json}.tmp"
        with open(tmp, "w") as f:
            json.dump({"device": args.device, "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)  # fmt: skip
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
