"""What loss scaling adds to an optimizer step, against `torch.amp.GradScaler`, in one process.

A transformer-sized parameter set (default about 100M FP32 parameters in a few hundred tensors,
gradients as autocast leaves them: FP32), and the part of a step that scaling touches: unscale +
inf check + optimizer step + update. Rows: no scaler (the bare optimizer step), GradScaler,
DynamicLossScaler (default config), DynamicLossScaler with min/max/hysteresis, and with telemetry
at its default interval (a step plus 1/interval of a telemetry snapshot, both measured); for
AdamW (foreach), AdamW (fused) and SGD. Variants are interleaved, repeat by repeat, and medians
reported with ratios against GradScaler. Also: the unscale-and-check pass against a single
`torch._foreach_mul_` over the same gradients (the memory-bound floor), and host reads
(`aten._local_scalar_dense`, the CPU proxy of a CUDA sync) added per step by each scaler.

    python benchmarks/step_overhead.py [--params 100e6 --tensors 300 --repeats 5] [--tiny] [--clip_only]

The clip table: the phase before the optimizer (unscale, overflow check, clip to norm 1) and the
whole step, for torch's `GradScaler.unscale_` + `clip_grad_norm_`, a DeepSpeed-style fold (norm of
the scaled gradients, one multiply), and `DynamicLossScaler.clip_grad_norm_` with fused and foreach
AdamW; ratios against torch's sequence with the same optimizer, the spread over the repeats, host
reads added.

Writes benchmarks/results/step_overhead.json (step_overhead_clip.json with --clip_only). On CUDA it
reports absolute times, with the GPU named.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from hf_lossscale import DynamicLossScaler, LossScaleConfig
from hf_lossscale.core.telemetry import GradientTelemetry
from hf_lossscale.tools.bf16 import cpu_name

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from sync_count import count_reads  # noqa: E402  (the tests' host-read counter)

OPTIMIZERS = ["adamw_foreach", "adamw_fused", "sgd"]
ROWS = ["no scaler", "GradScaler", "DynamicLossScaler", "DynamicLossScaler min/max/hysteresis", "+ telemetry"]


def make_params(total: float, tensors: int, device: str) -> list[torch.nn.Parameter]:
    """Transformer-like shapes: a few large matrices, many vectors; `total` elements in all."""
    g = torch.Generator().manual_seed(0)
    n_mat = max(1, tensors // 2)
    side = int((total / n_mat) ** 0.5)
    shapes = [(side, side)] * n_mat + [(side,)] * (tensors - n_mat)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device) * 0.02) for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(device) * 2.0**16  # scaled FP32 grads
    return params


def make_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)
    return torch.optim.AdamW(params, lr=1e-5, foreach=kind == "adamw_foreach", fused=kind == "adamw_fused")


def make_scaler(row: str, device: str):
    if row == "no scaler":
        return None
    if row == "GradScaler":
        return torch.amp.GradScaler(device, init_scale=2.0**16)
    config = LossScaleConfig(telemetry_interval=0)
    if row == "DynamicLossScaler min/max/hysteresis":
        config = config.replace(min_scale=16.0, max_scale=2.0**20, hysteresis=2)
    return DynamicLossScaler(config, device=device)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def restore(grads: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    """Put the same scaled gradients back before each measured step."""
    for g, s in zip(grads, saved, strict=True):
        g.copy_(s)


def optimizer_step(scaler, opt) -> None:
    """One optimizer step, through `scaler` unless it is None."""
    if scaler is None:
        opt.step()
    else:
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()


CLIP_ROWS = {
    # row: (optimizer, torch baseline row for the ratio)
    "torch: unscale_ + clip_grad_norm_ (AdamW foreach)": ("adamw_foreach", None),
    "torch: unscale_ + clip_grad_norm_ (AdamW fused)": ("adamw_fused", None),
    "DeepSpeed-style: norm, then one multiply (AdamW foreach)": (
        "adamw_foreach",
        "torch: unscale_ + clip_grad_norm_ (AdamW foreach)",
    ),
    "ours: clip_grad_norm_ (AdamW fused)": ("adamw_fused", "torch: unscale_ + clip_grad_norm_ (AdamW fused)"),
    "ours: clip_grad_norm_ (AdamW foreach)": (
        "adamw_foreach",
        "torch: unscale_ + clip_grad_norm_ (AdamW foreach)",
    ),
}
MAX_NORM = 1.0


def clip_phase(row: str, scaler, opt, params):
    """The part before the optimizer: unscale, overflow check and clip. Returns the step to run after."""
    if row.startswith("torch"):
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        return lambda: (scaler.step(opt), scaler.update())
    if row.startswith("ours"):
        scaler.clip_grad_norm_(opt, MAX_NORM, parameters=params)
        return lambda: (scaler.step(opt), scaler.update())
    # DeepSpeed's FP16 optimizer: the norm of the scaled gradients gives the overflow flag and the
    # clip coefficient; one multiply by coefficient / scale; the flag is read on the host to skip.
    grads = [p.grad for p in params]
    scale = scaler["scale"]
    norm = torch.nn.utils.get_total_norm(grads) / scale
    found = ~torch.isfinite(norm)
    coef = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef / scale)
    return lambda: None if found.item() else opt.step()


def quartiles(values: list[float]) -> list[float]:
    """First and third quartiles (the middle half of the paired ratios: the noise we state)."""
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], q[2]]


def measure_clip(opts: argparse.Namespace, device: str, params, grads, saved) -> dict:
    """The clip table: torch's sequence (5 passes over the gradients before the optimizer), the
    DeepSpeed-style fold (3), ours with fused AdamW (1) and with foreach AdamW (3); interleaved."""
    opts_by_kind = {kind: make_optimizer(kind, params) for kind in ("adamw_foreach", "adamw_fused")}
    scalers = {}
    for row in CLIP_ROWS:
        if row.startswith("torch"):
            scalers[row] = torch.amp.GradScaler(device, init_scale=2.0**16)
        elif row.startswith("ours"):
            scalers[row] = DynamicLossScaler(LossScaleConfig(telemetry_interval=0), device=device)
        else:
            scalers[row] = {"scale": torch.full((), 2.0**16, device=device)}
    for s in scalers.values():
        if not isinstance(s, dict):
            s.scale(torch.ones((), device=device))

    def one(row):
        opt = opts_by_kind[CLIP_ROWS[row][0]]
        restore(grads, saved)  # not timed
        sync(device)
        t0 = time.perf_counter()
        rest = clip_phase(row, scalers[row], opt, params)
        sync(device)
        t1 = time.perf_counter()
        rest()
        sync(device)
        return t1 - t0, time.perf_counter() - t0

    for row in CLIP_ROWS:
        one(row)  # warm-up: optimizer state
    phase: dict[str, list[float]] = {row: [] for row in CLIP_ROWS}
    step: dict[str, list[float]] = {row: [] for row in CLIP_ROWS}
    for _ in range(opts.repeats):
        for row in CLIP_ROWS:
            a, b = one(row)
            phase[row].append(a)
            step[row].append(b)

    # host reads per step beyond the bare optimizer step's own
    bare = {}
    for kind, opt in opts_by_kind.items():
        restore(grads, saved)
        bare[kind] = count_reads(opt.step)
    syncs = {}
    for row in CLIP_ROWS:
        opt = opts_by_kind[CLIP_ROWS[row][0]]
        restore(grads, saved)
        syncs[row] = (
            count_reads(lambda row=row, opt=opt: clip_phase(row, scalers[row], opt, params)())
            - bare[CLIP_ROWS[row][0]]
        )

    out = {}
    for row, (kind, base) in CLIP_ROWS.items():
        base = base or row
        # paired by repeat (the rows of one repeat run back to back): the noise is the spread of
        # these ratios, and "faster beyond noise" means faster in every repeat
        phase_ratios = [a / b for a, b in zip(phase[row], phase[base], strict=True)]
        step_ratios = [a / b for a, b in zip(step[row], step[base], strict=True)]
        out[row] = {
            "optimizer": kind,
            "phase_median_s": statistics.median(phase[row]),
            "step_median_s": statistics.median(step[row]),
            "phase_vs_torch": statistics.median(phase_ratios),
            "phase_vs_torch_quartiles": quartiles(phase_ratios),
            "phase_faster_in": sum(r < 1 for r in phase_ratios),
            "step_vs_torch": statistics.median(step_ratios),
            "step_vs_torch_quartiles": quartiles(step_ratios),
            "step_faster_in": sum(r < 1 for r in step_ratios),
            "repeats": len(step_ratios),
            "syncs_added": syncs[row],
        }

    # what one pass over the gradients costs here: the floor of each design, in passes
    found, inv = torch.zeros((), device=device), torch.ones((), device=device)
    passes = {
        "norm (read)": lambda: torch._foreach_norm(grads, 2.0),
        "multiply (read + write)": lambda: torch._foreach_mul_(grads, 1.0),
        "unscale + check (read + write)": lambda: torch._amp_foreach_non_finite_check_and_unscale_(
            grads, found, inv
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(opts.repeats):
        for name, fn in passes.items():
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t)
    pass_s = {name: statistics.median(v) for name, v in times.items()}
    torch_passes = sum(pass_s.values())  # unscale, norm, multiply: torch's sequence
    return {
        "rows": out,
        "passes_median_s": pass_s,
        # the phase ratios these passes allow: ours fused = one norm; ours foreach = norm + multiply
        "floor_fused_vs_torch": pass_s["norm (read)"] / torch_passes,
        "floor_foreach_vs_torch": (pass_s["norm (read)"] + pass_s["multiply (read + write)"]) / torch_passes,
    }


def measure(opts: argparse.Namespace) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = make_params(opts.params, opts.tensors, device)
    grads = [p.grad for p in params]
    saved = [g.clone() for g in grads]
    results: dict = {"rows": {}, "syncs": {}}
    results["clip"] = measure_clip(opts, device, params, grads, saved)
    if opts.clip_only:
        results["setup"] = setup(opts, device, params)
        return results
    telemetry_interval = LossScaleConfig().telemetry_interval
    for kind in OPTIMIZERS:
        opt = make_optimizer(kind, params)
        scalers = {row: make_scaler(row, device) for row in ROWS[:-1]}

        def one_step(row, scalers=scalers, opt=opt):
            restore(grads, saved)  # not timed
            sync(device)
            t = time.perf_counter()
            optimizer_step(scalers[row], opt)
            sync(device)
            return time.perf_counter() - t

        def snapshot():
            telemetry = GradientTelemetry(1)
            sync(device)
            t = time.perf_counter()
            telemetry.observe(((str(i), g) for i, g in enumerate(grads)), 0)
            telemetry.end_iteration(0)
            sync(device)
            return time.perf_counter() - t

        # Every scaler needs one scale() call to create its state on the device.
        for s in scalers.values():
            if s is not None:
                s.scale(torch.ones((), device=device))
        for row in scalers:
            one_step(row)  # warm-up
        times: dict[str, list[float]] = {row: [] for row in ROWS}
        for _ in range(opts.repeats):  # interleaved
            for row in scalers:
                times[row].append(one_step(row))
            times["+ telemetry"].append(snapshot())
        med = {row: statistics.median(v) for row, v in times.items()}
        med["+ telemetry"] = med["DynamicLossScaler"] + med["+ telemetry"] / telemetry_interval
        base = med["GradScaler"]
        results["rows"][kind] = {
            row: {"median_s": med[row], "vs_GradScaler": med[row] / base} for row in ROWS
        }

        # host reads per step, minus the bare optimizer's own
        # the same with a telemetry snapshot in the step (interval 1)
        telemetry_scaler = DynamicLossScaler(LossScaleConfig(telemetry_interval=1), device=device)
        telemetry_scaler.scale(torch.ones((), device=device))
        counts = {}
        for row, scaler in {**scalers, "+ telemetry": telemetry_scaler}.items():
            restore(grads, saved)
            counts[row] = count_reads(lambda scaler=scaler, opt=opt: optimizer_step(scaler, opt))
        results["syncs"][kind] = {row: counts[row] - counts["no scaler"] for row in counts}

    # the scaler's own part alone (unscale + inf check + update, no optimizer step), interleaved
    opt = make_optimizer("sgd", params)
    alone = {row: make_scaler(row, device) for row in ROWS[1:-1]}
    for s in alone.values():
        s.scale(torch.ones((), device=device))
    own: dict[str, list[float]] = {row: [] for row in alone}
    for _ in range(opts.repeats + 1):
        for row, scaler in alone.items():
            restore(grads, saved)
            sync(device)
            t = time.perf_counter()
            scaler.unscale_(opt)
            scaler.update()
            sync(device)
            own[row].append(time.perf_counter() - t)
    own_med = {row: statistics.median(v[1:]) for row, v in own.items()}  # the first is a warm-up
    results["scaler_only"] = {
        row: {"median_s": m, "vs_GradScaler": m / own_med["GradScaler"]} for row, m in own_med.items()
    }

    # distance to the memory-bound floor: unscale-and-check vs one foreach multiply
    found = torch.zeros((), device=device)
    inv = torch.full((), 1.0, device=device)
    floor, ours = [], []
    for _ in range(opts.repeats):
        sync(device)
        t = time.perf_counter()
        torch._foreach_mul_(grads, 1.0)
        sync(device)
        floor.append(time.perf_counter() - t)
        t = time.perf_counter()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        sync(device)
        ours.append(time.perf_counter() - t)
    results["unscale_check_vs_foreach_mul"] = statistics.median(ours) / statistics.median(floor)
    results["unscale_check_median_s"] = statistics.median(ours)
    results["foreach_mul_median_s"] = statistics.median(floor)
    results["setup"] = setup(opts, device, params)
    return results


def setup(opts: argparse.Namespace, device: str, params) -> dict:
    return {
        "device": torch.cuda.get_device_name()
        if device == "cuda"
        else f"cpu ({torch.get_num_threads()} threads)",
        "machine": cpu_name(),
        "torch": torch.__version__,
        "parameters": sum(p.numel() for p in params),
        "tensors": len(params),
        "repeats": opts.repeats,
        "telemetry_interval": LossScaleConfig().telemetry_interval,
        "absolute_times_meaningful": device == "cuda",
    }


def clip_table(clip: dict) -> str:
    lines = [
        "| row | before the optimizer | x torch [quartiles], faster in | whole step | x torch [quartiles], faster in | syncs added |",
        "|---|---|---|---|---|---|",
    ]
    for row, r in clip["rows"].items():
        pq, sq, n = r["phase_vs_torch_quartiles"], r["step_vs_torch_quartiles"], r["repeats"]
        baseline = r["phase_vs_torch"] == 1 and pq == [1, 1]
        lines.append(
            f"| {row} | {r['phase_median_s'] * 1e3:.1f} ms | "
            + (
                "baseline"
                if baseline
                else f"x{r['phase_vs_torch']:.2f} [{pq[0]:.2f}, {pq[1]:.2f}], {r['phase_faster_in']}/{n}"
            )
            + f" | {r['step_median_s'] * 1e3:.1f} ms | "
            + (
                "baseline"
                if baseline
                else f"x{r['step_vs_torch']:.2f} [{sq[0]:.2f}, {sq[1]:.2f}], {r['step_faster_in']}/{n}"
            )
            + f" | +{r['syncs_added']} |"
        )
    passes = ", ".join(f"{name} {t * 1e3:.1f} ms" for name, t in clip["passes_median_s"].items())
    lines.append("")
    lines.append(
        f"One pass over the gradients: {passes}. The phase ratios these allow: "
        f"x{clip['floor_fused_vs_torch']:.2f} (one norm) and x{clip['floor_foreach_vs_torch']:.2f} (norm + multiply)."
    )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--tiny", action="store_true", help="10k parameters in 20 tensors (smoke test).")
    parser.add_argument("--clip_only", action="store_true", help="Only the clip table.")
    parser.add_argument(
        "--output",
        default=None,
        help="Default: results/step_overhead.json (step_overhead_clip.json with --clip_only).",
    )
    opts = parser.parse_args(argv)
    if opts.tiny:
        opts.params, opts.tensors, opts.repeats = 1e4, 20, min(opts.repeats, 2)
    if opts.output is None:
        name = "step_overhead_clip.json" if opts.clip_only else "step_overhead.json"
        opts.output = str(Path(__file__).parent / "results" / name)
    result = measure(opts)
    Path(opts.output).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.output).write_text(json.dumps(result, indent=2))
    print(f"clip (max_norm {MAX_NORM}), medians over {opts.repeats} interleaved repeats")
    print(clip_table(result["clip"]))
    for kind, rows in result["rows"].items():
        print(kind)
        for row, r in rows.items():
            sy = result["syncs"][kind].get(row, "—")
            print(
                f"  {row:<38} {r['median_s'] * 1e3:9.2f} ms  x{r['vs_GradScaler']:.3f} vs GradScaler  syncs +{sy}"
            )
    if opts.clip_only:
        return result
    print("scaler only (unscale + check + update)")
    for row, r in result["scaler_only"].items():
        print(f"  {row:<38} {r['median_s'] * 1e3:9.2f} ms  x{r['vs_GradScaler']:.3f} vs GradScaler")
    print(f"unscale+check / foreach_mul = {result['unscale_check_vs_foreach_mul']:.3f}")
    return result


if __name__ == "__main__":
    main()
