"""`hf-lossscale report RUN_DIR`: a run's event log (`loss_scale_log.jsonl`) as PNG plots and a
Markdown summary: the loss scale per step with skipped steps marked, the loss, and heat maps of the
gradient exponent histograms over steps with FP16's underflow and overflow limits drawn.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from ..core.events import EVENT_LOG_NAME, read_run_events, train_log_series
from ..core.overflow import display_origin
from ..core.telemetry import BUCKETS, MAX_EXP, MIN_EXP, bucket_index

__all__ = ["add_report_arguments", "make_report", "exponent_heatmap", "latest_attempt"]


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help=f"A run's output_dir (holding {EVENT_LOG_NAME}).")
    parser.add_argument(
        "--output_dir", default=None, help="Where to write the report (default: RUN_DIR/report)."
    )


def plot_scale(ax, steps: list[int], scales: list[float | None], skipped_at: list[int], **style: Any) -> bool:
    """The loss scale per step (log2 axis) with skipped steps marked x; False if there is no scale."""
    points = [(s, v) for s, v in zip(steps, scales, strict=True) if v is not None]
    if not points:
        return False
    ax.step(*zip(*points, strict=True), where="post", **style)
    skipped = set(skipped_at)  # once, not per point: linear in the points
    marks = [(s, v) for s, v in points if s in skipped]
    if marks:
        ax.scatter(*zip(*marks, strict=True), marker="x", color=style.get("color", "red"), zorder=3)
    ax.set_yscale("log", base=2)
    return True


def exponent_heatmap(ax, snapshots: list[dict[str, Any]], title: str) -> None:
    """Draw telemetry snapshots (each with `counts` per exponent bucket) as a heatmap on the
    matplotlib axes `ax`: one column per snapshot, one row per bucket, shaded by the share of
    elements."""
    import numpy as np

    matrix = np.array([[c / max(sum(s["counts"]), 1) for c in s["counts"]] for s in snapshots]).T
    steps = [s["step"] for s in snapshots]
    masked = np.ma.masked_where(matrix <= 0, matrix)
    image = ax.imshow(
        np.ma.log10(masked), aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
        extent=(-0.5, len(steps) - 0.5, -0.5, len(BUCKETS) - 0.5),
    )  # fmt: skip
    ax.figure.colorbar(image, ax=ax, label="log10(fraction of elements)")
    ticks = [
        0,
        1,
        *range(bucket_index(-20), bucket_index(MAX_EXP) + 1, 5),
        len(BUCKETS) - 2,
        len(BUCKETS) - 1,
    ]
    ax.set_yticks(ticks, [BUCKETS[t] for t in ticks], fontsize=7)
    for y, label, color in [
        (bucket_index(MIN_EXP) - 0.5, "FP16 underflow (2^-24)", "red"),
        (bucket_index(-14) - 0.5, "subnormal below 2^-14", "orange"),
        (bucket_index(MAX_EXP) + 0.5, "FP16 overflow (65504)", "red"),
    ]:
        ax.axhline(y, color=color, linestyle="--", linewidth=1)
        ax.text(len(steps) - 0.5, y + 0.2, label, color=color, fontsize=7, ha="right")
    shown = list(range(0, len(steps), max(1, len(steps) // 10)))
    ax.set_xticks(shown, [str(steps[i]) for i in shown])
    ax.set_xlabel("optimizer step")
    ax.set_title(title)


#: Events that belong to a step: an attempt that a resume discarded wrote some past its checkpoint.
_STEPPED = ("log", "telemetry", "overflow", "flushed_probe", "error")


def latest_attempt(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of the steps as they stand: when a resumed run logs a training step at or before
    one already logged (it went back to its checkpoint), what the earlier attempt wrote from that
    step on is dropped (it was discarded: the curve reads 1..8 then 6, 7, 8, 9 otherwise)."""
    out: list[dict[str, Any]] = []
    last = None
    for e in events:
        if e.get("event") == "log" and "loss" in e and "eval_loss" not in e:
            try:
                step = float(e["step"])
            except (TypeError, ValueError):
                step = None
            if step is not None and last is not None and step <= last:
                out = [o for o in out if not (o.get("event") in _STEPPED and _at_or_after(o, step))]
            last = step if step is not None else last
        out.append(e)
    return out


def _at_or_after(event: dict[str, Any], step: float) -> bool:
    try:
        return float(event.get("step")) >= step
    except (TypeError, ValueError):
        return False


def _bits(value: float | None) -> str:
    """headroom_bits for the page: the event log writes a non-finite figure as null (-inf: the snapshot
    held inf/NaN; +inf: only zeros)."""
    return "n/a (not finite)" if value is None else f"{value:.1f}"


def _bits_key(value: float | None) -> float:
    return -math.inf if value is None else value


_GRAD_KEYS = ("zero_frac", "subnormal_frac", "below_fp16_frac", "headroom_bits", "per_module")
_ACT_KEYS = ("lost_frac", "headroom_bits")


def make_report(run_dir: str | Path, output_dir: str | Path | None = None) -> dict[str, Any]:
    """Write `report.md` and the PNGs; return what was written and the figures used."""
    from .._extras import need

    matplotlib = need("matplotlib", "hf-lossscale report's plots", "tools")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    log = run_dir / EVENT_LOG_NAME
    if not log.is_file():
        raise FileNotFoundError(
            f"No {EVENT_LOG_NAME} in {run_dir}: is it the output_dir of a LossScaleTrainer run?"
        )
    skipped: list[int] = []
    events = latest_attempt(read_run_events(log, skipped))
    out = Path(output_dir) if output_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    series = train_log_series(events)
    evals = [(e["step"], e["eval_loss"]) for e in events if e.get("event") == "log" and "eval_loss" in e]
    start = next((e for e in events if e.get("event") == "run_start"), {})
    end = next((e for e in reversed(events) if e.get("event") == "run_end"), None)
    grads = [e for e in events if e.get("event") == "telemetry" and e.get("source") == "param_grads"]
    acts = [e for e in events if e.get("event") == "telemetry" and e.get("source") == "activation_grads"]
    # snapshots without the figures the summary reads count as unreadable too
    usable = (
        [e for e in grads if all(k in e for k in _GRAD_KEYS)],
        [e for e in acts if all(k in e for k in _ACT_KEYS)],
    )
    skipped = [(skipped[0] if skipped else 0) + len(grads) + len(acts) - len(usable[0]) - len(usable[1])]
    grads, acts = usable
    overflows = [e for e in events if e.get("event") == "overflow"]
    probes = [e for e in events if e.get("event") == "flushed_probe"]
    errors = [e for e in events if e.get("event") == "error"]
    written = []

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7.5, 6), sharex=True)
    if plot_scale(
        ax1, series["steps"], series["scales"], series["skipped_at"], label="loss scale (x = skipped)"
    ):
        ax1.legend(fontsize=8)
    ax1.set_ylabel("loss scale")
    ax2.plot(series["steps"], series["losses"], label="train loss")
    if evals:
        ax2.plot(*zip(*evals, strict=True), marker="o", label="eval loss")
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("loss")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "scale_and_loss.png", dpi=110)
    plt.close(fig)
    written.append("scale_and_loss.png")

    for snapshots, name, title in [
        (grads, "grad_exponents.png", "Scaled parameter gradients on the FP16 number line"),
        (acts, "activation_grad_exponents.png", "Activation gradients (sampled) on the FP16 number line"),
    ]:
        if snapshots:
            fig, ax = plt.subplots(figsize=(8, 6))
            exponent_heatmap(ax, snapshots, title)
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            plt.close(fig)
            written.append(name)

    lines = [f"# Loss-scaling report: `{run_dir}`", ""]
    if skipped and skipped[0]:
        lines += [f"- **{skipped[0]} unreadable line(s) of {EVENT_LOG_NAME} skipped** (a crash mid-write, "
                  "or lines missing the fields their event needs)"]  # fmt: skip
    if start:
        lines += [
            f"- precision: {start.get('mixed_precision')}, FP16: {start.get('fp16') or '—'}, "
            f"world size {start.get('world_size')}, gradient accumulation {start.get('gradient_accumulation_steps')}",
            f"- versions: {start.get('versions')}",
            f"- loss-scale config: `{start.get('loss_scale_config')}`",
        ]
    if end is not None and "total_steps" in end:
        rate = end["skipped_steps"] / max(end["total_steps"], 1)
        lines.append(
            f"- {end['total_steps']} optimizer steps, {end['skipped_steps']} skipped ({rate:.1%}), final scale "
            f"{end['loss_scale']:g}"
        )
    for e in errors:
        lines.append(f"- **stopped by {e['type']}** at step {e['step']}: {e['message'][:300]}")
    if grads:
        last = grads[-1]
        lines += [
            "",
            f"## Gradient telemetry ({len(grads)} snapshots; the last at step {last['step']})",
            "",
            f"Scaled parameter gradients: zero {last['zero_frac']:.2%}, subnormal in FP16 (< 2^-14) "
            f"{last['subnormal_frac']:.2%}, below 2^-24 {last['below_fp16_frac']:.2%}, headroom "
            f"{_bits(last['headroom_bits'])} bits. Zeros include what FP16 already flushed (see the notes in "
            "`hf_lossscale.core.telemetry`).",
            "",
            "| module | zero | subnormal | headroom (bits) |",
            "|---|---|---|---|",
        ]
        modules = sorted(
            last["per_module"].items(), key=lambda kv: _bits_key(kv[1].get("headroom_bits", math.inf))
        )
        for name, m in modules:
            lines.append(
                f"| {name} | {m['zero_frac']:.2%} | {m['subnormal_frac']:.2%} | {_bits(m.get('headroom_bits', math.nan))} |"
            )
    if acts:
        last = acts[-1]
        lines += ["", f"Activation gradients (sampled, step {last['step']}): lost (zero or < 2^-24) "
                  f"{last['lost_frac']:.2%}; headroom {_bits(last['headroom_bits'])} bits."]  # fmt: skip
    if overflows:
        lines += ["", "## Skipped steps diagnosed", ""]
        for e in overflows:
            where = (f"{e['kind']} overflow starting in {display_origin(e['origin'])}; " if e.get("origin") is not None
                     else (f"{e['kind']} overflow; " if e.get("kind") else ""))  # fmt: skip
            lines.append(
                f"- step {e['step']}: {where}non-finite gradients in {', '.join(e['modules']) or '(not found)'}"
                f" ({e['n_params']} tensors); loss non-finite: {e.get('loss_nonfinite')}; scale after: "
                f"{e['loss_scale_after']:g}"
            )
    if probes:
        lines += ["", "## Flushed fraction (FP16 vs an FP32 pass, first batch)", ""]
        for e in probes:
            value = "overflow" if e["overflow"] else f"{e['flushed_fraction']:.2%}"
            lines.append(f"- {e['when']} (step {e['step']}, scale {e['scale']:g}): {value}")
    lines += ["", "Plots: " + ", ".join(f"`{w}`" for w in written), ""]
    (out / "report.md").write_text("\n".join(lines))
    written.append("report.md")
    return {
        "output_dir": str(out),
        "written": written,
        "skipped_lines": skipped[0] if skipped else 0,
        "telemetry_snapshots": len(grads),
        "overflows": len(overflows),
    }
