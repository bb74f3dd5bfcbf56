"""Device ops per optimizer step that loss scaling adds, `DynamicLossScaler` against `torch.amp.GradScaler`.

Counted with a `TorchDispatchMode`: every top-level aten op the scaler's calls dispatch, views and
bare allocations (`empty`, `empty_strided`) left out, the optimizer's own `step()` not counted
(paused around it). On CUDA each counted op is at least one kernel launch (a `_foreach_` op one
multi-tensor launch), which is what bounds small models and short steps on a GPU. Deterministic:
the counts are exact, and `tests/test_benchmarks.py` holds the table's rows to them.

Model: a 20-layer MLP (64 wide), FP32 parameters, one batch per step. Rows:

- clean step, fused AdamW, no clip: `scale` + `step` + `update`;
- clean step, fused AdamW, clip: torch `unscale_` + `clip_grad_norm_`, ours `clip_grad_norm_`;
- clean step, foreach AdamW, no clip / clip: the same with the foreach optimizer (whose step reads
  the overflow flag on the host, with either scaler: one op, and our update then knows the step);
- around a skipped step (fused and foreach, without and with clip): ops of the skipped step and the
  step after it, minus two clean steps;
- the variants (min/max scale, hysteresis, telemetry at every step) on the first row.

And the first step of a run (lazy set-up) in milliseconds, at 20M parameters, median of 7 fresh
runs interleaved: ours (with the default telemetry, whose first snapshot is at step 0, and without)
against torch's.

With `--device cuda` the counts run on the GPU (the same ops, plus the non-blocking copies a CUDA
run makes), and a launch table is added: CUDA kernels per whole step (forward, backward, scaler,
optimizer; memcpy and memset included), counted with `torch.profiler` over 20 clean steps, and the
wall time per step (median of 5 runs of 100 steps, each ended by one synchronisation), for no scaler
(FP32 step), torch's `GradScaler` and ours, on the same 20-layer MLP: the launch-bound case.

    python benchmarks/op_count.py [--json benchmarks/results/op_count.json] [--device cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_lossscale import DynamicLossScaler

_NOT_COUNTED = {"empty.memory_format", "empty_strided.default", "lift_fresh.default", "detach.default"}


class OpCounter(TorchDispatchMode):
    """Counts top-level aten ops (views and allocations left out) while not `paused`."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"{func.overloadpacket.__name__}.{func._overloadname}"
        if not self.paused and not func.is_view and name not in _NOT_COUNTED:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def mlp(layers: int = 20, width: int = 64, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods)


def make_optimizer(kind: str, model: torch.nn.Module, capturable: bool = False) -> torch.optim.Optimizer:
    fused = kind == "fused"
    return torch.optim.AdamW(
        model.parameters(), lr=1e-3, fused=fused, foreach=not fused, capturable=capturable
    )


def _pause_in_step(optimizer: torch.optim.Optimizer, counter: OpCounter) -> None:
    """Leave the optimizer's own ops out: the count pauses inside its `step()`."""
    original = optimizer.step

    def step(*args, **kwargs):
        counter.paused = True
        try:
            return original(*args, **kwargs)
        finally:
            counter.paused = False

    optimizer.step = step


def one_step(scaler, model, opt, x, *, clip: bool, ours: bool, inject_inf: bool, counter: OpCounter | None):
    """Forward and backward uncounted; the scaler's part of one step counted. `scaler=None`: the
    plain FP32 step (clip with `torch.nn.utils.clip_grad_norm_`)."""
    opt.zero_grad(set_to_none=True)
    loss = model(x).pow(2).mean()
    if scaler is None:
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return
    ctx = counter if counter is not None else contextlib.nullcontext()
    with ctx:
        scaled = scaler.scale(loss)
    scaled.backward()
    if inject_inf:
        with torch.no_grad():
            model[0].weight.grad[0, 0] = float("inf")
    with ctx:
        if clip:
            if ours:
                scaler.clip_grad_norm_(opt, 1.0)
            else:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()


DEVICE = "cpu"  # --device


def _model_and_batch(device: str):
    model = mlp().to(device)
    return model, torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(device)


def count(make_scaler, *, optimizer: str, clip: bool, ours: bool, skip: bool = False) -> int:
    """Ops the scaler adds to one clean step (after 3 warm-up steps), or, with `skip`, to a skipped
    step plus the step after it beyond two clean steps."""
    model, x = _model_and_batch(DEVICE)
    opt = make_optimizer(optimizer, model)
    scaler = make_scaler()
    counter = OpCounter()
    _pause_in_step(opt, counter)
    for _ in range(3):
        one_step(scaler, model, opt, x, clip=clip, ours=ours, inject_inf=False, counter=None)
    clean = []
    for _ in range(2):
        counter.ops.clear()
        one_step(scaler, model, opt, x, clip=clip, ours=ours, inject_inf=False, counter=counter)
        clean.append(counter.total)
    if clean[0] != clean[1]:
        if DEVICE == "cpu":
            raise RuntimeError(f"clean steps differ in ops: {clean}")
        print(f"note: two clean steps differ in ops on {DEVICE}: {clean} (the larger counted)")
        clean[0] = max(clean)
    if not skip:
        return clean[0]
    counter.ops.clear()
    one_step(scaler, model, opt, x, clip=clip, ours=ours, inject_inf=True, counter=counter)
    one_step(scaler, model, opt, x, clip=clip, ours=ours, inject_inf=False, counter=counter)
    return counter.total - 2 * clean[0]


SCALERS = {
    "torch": lambda: torch.amp.GradScaler(DEVICE, init_scale=2.0**10),
    "ours": lambda: DynamicLossScaler(init_scale=2.0**10),
    "ours, min/max scale": lambda: DynamicLossScaler(init_scale=2.0**10, min_scale=2.0, max_scale=2.0**20),
    "ours, hysteresis 2": lambda: DynamicLossScaler(init_scale=2.0**10, hysteresis=2),
    "ours, telemetry every step": lambda: DynamicLossScaler(init_scale=2.0**10, telemetry_interval=1),
}

ROWS = [
    ("clean step, fused AdamW, no clip", dict(optimizer="fused", clip=False)),
    ("clean step, fused AdamW, clip", dict(optimizer="fused", clip=True)),
    ("clean step, foreach AdamW, no clip", dict(optimizer="foreach", clip=False)),
    ("clean step, foreach AdamW, clip", dict(optimizer="foreach", clip=True)),
    (
        "around a skipped step (beyond two clean steps), fused, no clip",
        dict(optimizer="fused", clip=False, skip=True),
    ),
    (
        "around a skipped step (beyond two clean steps), fused, clip",
        dict(optimizer="fused", clip=True, skip=True),
    ),
    (
        "around a skipped step (beyond two clean steps), foreach, no clip",
        dict(optimizer="foreach", clip=False, skip=True),
    ),
    (
        "around a skipped step (beyond two clean steps), foreach, clip",
        dict(optimizer="foreach", clip=True, skip=True),
    ),
]


def table() -> list[dict]:
    rows = []
    for name, kw in ROWS:
        row = {"row": name, "torch": count(SCALERS["torch"], ours=False, **kw)}
        row["ours"] = count(SCALERS["ours"], ours=True, **kw)
        rows.append(row)
    variants = {}
    for label in ("ours, min/max scale", "ours, hysteresis 2", "ours, telemetry every step"):
        variants[label] = count(SCALERS[label], ours=True, optimizer="fused", clip=False)
    return rows, variants


LAUNCH_ROWS = [
    ("fused AdamW, no clip", dict(optimizer="fused", clip=False)),
    ("fused AdamW, clip", dict(optimizer="fused", clip=True)),
    ("foreach AdamW, clip", dict(optimizer="foreach", clip=True)),
    ("fused AdamW, no clip, captured in a CUDA graph", dict(optimizer="fused", clip=False, graph=True)),
    ("fused AdamW, clip, captured in a CUDA graph", dict(optimizer="fused", clip=True, graph=True)),
]
LAUNCH_SCALERS = {"no scaler": None, "torch": "torch", "ours": "ours"}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _kernels_per_step(run, steps: int) -> float | None:
    """CUDA kernels (memcpy and memset included) per call of `run`, from the profiler; None on the CPU."""
    if DEVICE != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _sync(DEVICE)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        _sync(DEVICE)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return len(kernels) / steps


def _captured(run):
    """`run` captured once in a CUDA graph (after warm-up on a side stream); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def _runner(kw: dict, which: str | None):
    model, x = _model_and_batch(DEVICE)
    graph = kw.get("graph", False)
    opt = make_optimizer(kw["optimizer"], model, capturable=graph)  # a graph's step reads no host value
    scaler = None if which is None else SCALERS[which]()

    def run():
        if graph:
            opt.zero_grad(set_to_none=False)  # the graph's gradients stay where they were captured
        one_step(scaler, model, opt, x, clip=kw["clip"], ours=which == "ours", inject_inf=False, counter=None)

    for _ in range(5):
        run()
    return _captured(run) if graph else run


def launch_table(steps: int = 100, runs: int = 5, profiled: int = 20) -> list[dict]:
    """Per row: kernels per whole step and ms per step for no scaler, torch and ours (clean steps,
    after 5 warm-up steps; the variants interleaved run by run). A variant that fails (a capture
    refused, say) is reported with its error instead."""
    out = []
    for name, kw in LAUNCH_ROWS:
        if kw.get("graph") and DEVICE != "cuda":
            continue
        row: dict = {"row": name}
        runners = {}
        for label, which in LAUNCH_SCALERS.items():
            try:
                runners[label] = _runner(kw, which)
            except Exception as exc:  # noqa: BLE001  (reported, not hidden)
                row[label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        times: dict[str, list[float]] = {k: [] for k in runners}
        for _ in range(runs):
            for label, run in runners.items():
                _sync(DEVICE)
                start = time.perf_counter()
                for _ in range(steps):
                    run()
                _sync(DEVICE)
                times[label].append((time.perf_counter() - start) * 1e3 / steps)
        for label, run in runners.items():
            row[label] = {
                "kernels_per_step": _kernels_per_step(run, profiled),
                "ms_per_step": statistics.median(times[label]),
                "spread": max(times[label]) / min(times[label]) - 1,
            }
        out.append(row)
    return out


def _first_step_ms(make_scaler, width: int) -> float:
    """Wall time of a fresh scaler's first scale + step + update (fused AdamW; the forward and the
    backward not timed; the optimizer's own first step included, the same for every scaler)."""
    model = mlp(layers=20, width=width).to(DEVICE)
    opt = make_optimizer("fused", model)
    loss = model(torch.randn(4, width, device=DEVICE)).pow(2).mean()
    scaler = make_scaler()
    _sync(DEVICE)
    start = time.perf_counter()
    scaled = scaler.scale(loss)
    _sync(DEVICE)
    mark = time.perf_counter()
    scaled.backward()
    _sync(DEVICE)
    resume = time.perf_counter()
    scaler.step(opt)
    scaler.update()
    _sync(DEVICE)
    return (mark - start + time.perf_counter() - resume) * 1e3


FIRST_STEP = {
    "torch": SCALERS["torch"],
    "ours": SCALERS["ours"],
    "ours, telemetry off": lambda: DynamicLossScaler(init_scale=2.0**10, telemetry_interval=0),
}


def first_step(params: float = 20e6, repeats: int = 7) -> dict:
    """Median first-step time per scaler, repeats interleaved (a fresh model and scaler each), with
    the spread (max/min - 1) of each; ratios against torch's median."""
    width = int((params / 20) ** 0.5)
    times: dict[str, list[float]] = {k: [] for k in FIRST_STEP}
    for _ in range(repeats):
        for name, make in FIRST_STEP.items():
            times[name].append(_first_step_ms(make, width))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        k: {"median_ms": med[k], "ratio_to_torch": med[k] / med["torch"], "spread": max(v) / min(v) - 1}
        for k, v in times.items()
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--no_first_step", action="store_true", help="Counts only (what the test runs).")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda adds the launch table).")
    parser.add_argument(
        "--graph_probe",
        choices=["none", "torch", "ours"],
        help="Only capture one scaler's fused-AdamW step in a CUDA graph, replay it 10 times and synchronise "
        "(run with CUDA_LAUNCH_BLOCKING=1 to name a failing kernel).",
    )
    parser.add_argument("--graph_probe_clip", type=int, default=0)
    parser.add_argument("--graph_probe_telemetry", type=int, default=None, help="ours' telemetry_interval")
    opts = parser.parse_args(argv)
    global DEVICE
    DEVICE = opts.device
    if opts.graph_probe:
        import faulthandler

        faulthandler.dump_traceback_later(20, exit=True)  # a hang names its line
        DEVICE = "cuda"
        if opts.graph_probe_telemetry is not None:
            SCALERS["ours"] = lambda: DynamicLossScaler(
                init_scale=2.0**10, telemetry_interval=opts.graph_probe_telemetry
            )
        kw = dict(optimizer="fused", clip=bool(opts.graph_probe_clip), graph=True)
        replay = _runner(kw, None if opts.graph_probe == "none" else opts.graph_probe)
        for _ in range(10):
            replay()
        torch.cuda.synchronize()
        print(f"graph probe {opts.graph_probe} clip={bool(opts.graph_probe_clip)}: 10 replays passed")
        return 0
    if DEVICE == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    print(f"device: {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}, torch {torch.__version__}")
    rows, variants = table()
    print("| ops the scaler adds per optimizer step | torch.amp.GradScaler | DynamicLossScaler |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['row']} | {r['torch']} | {r['ours']} |")
    print()
    for label, n in variants.items():
        print(f"- {label} (clean step, fused AdamW, no clip): {n}")
    out = {"device": DEVICE, "torch": torch.__version__, "rows": rows, "variants": variants}

    def save():
        if opts.json:
            Path(opts.json).write_text(json.dumps(out, indent=1) + "\n")

    save()
    if DEVICE == "cuda":
        out["device_name"] = torch.cuda.get_device_name()
        out["launches"] = launch_table()
        save()
        print("\n| whole clean step, 20-layer MLP | no scaler | torch GradScaler | DynamicLossScaler |")
        print("|---|---|---|---|")
        for r in out["launches"]:
            print(f"| {r['row']} | " + " | ".join(_cell(r[k]) for k in LAUNCH_SCALERS) + " |")
    if not opts.no_first_step:
        out["first_step"] = first_step()
        print("\nfirst step (20M parameters, fused AdamW, median of 7 interleaved; spread = max/min - 1):")
        for k, v in out["first_step"].items():
            print(
                f"- {k}: {v['median_ms']:.1f} ms, x{v['ratio_to_torch']:.2f} torch's (spread {v['spread']:.0%})"
            )
    save()
    return 0


def _cell(v: dict) -> str:
    if "error" in v:
        return f"failed: {v['error']}"
    kernels = "" if v["kernels_per_step"] is None else f"{v['kernels_per_step']:.0f} kernels, "
    return f"{kernels}{v['ms_per_step']:.3f} ms (spread {v['spread']:.0%})"


if __name__ == "__main__":
    raise SystemExit(main())
