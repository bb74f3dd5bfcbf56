"""The comparison's summary: statistics per setting, the paired verdicts against FP32, the
failure-mode words, and `summary.md`."""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import verdict
from .files import atomic_write_text
from .runs import SETTINGS, RunResult, is_metric


def fraction_text(probe: dict[str, Any] | None) -> str:
    if probe is None:
        return "—"
    if probe["overflow"]:
        return "overflow (inf/NaN)"
    return percent(probe["flushed_fraction"])


def percent(x: float) -> str:
    """A fraction as a percentage that never rounds a small non-zero value to 0."""
    return f"{x:.2%}" if x == 0 or x >= 1e-4 else f"{100 * x:.1e}%"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summarize(results: list[RunResult], opts: argparse.Namespace) -> dict[str, Any]:
    """Per-setting aggregates, the paired verdicts and the statements `summary.md` makes, all from
    `results` (the rules: `hf_lossscale.tools.verdict.RULES`)."""
    # a run that did not finish (a crash half-way) enters no verdict: its last mid-run evaluation is not
    # a final one. A collapse is an outcome (the scaler stopped the run): it stays, as "incomplete".
    left_out = [r for r in results if r.status == "failed"]
    results = [r for r in results if r.status != "failed"]
    records = [asdict(r) for r in results]
    by_setting: dict[str, list[RunResult]] = {}
    for r in results:
        by_setting.setdefault(r.setting, []).append(r)
    rows: dict[str, dict[str, Any]] = {}
    for setting, runs in by_setting.items():
        losses = [r.eval_loss for r in runs if r.eval_loss is not None]
        finite = [x for x in losses if math.isfinite(x)]
        rows[setting] = {
            "eval_loss": losses,
            "eval_loss_mean": _mean(finite) if finite and len(finite) == len(runs) else None,
            "spread": (max(finite) - min(finite)) if len(finite) >= 2 else None,
            "statuses": [r.status for r in runs],
        }
    fp32 = rows.get("fp32")
    statements = []
    floor = verdict.paired_verdict(records, "dynamic") if "dynamic" in rows and fp32 else None
    if fp32 is None and any(setting != "fp32" for setting in rows):
        statements.append("No verdict: no FP32 run finished, so there is no baseline to compare with.")
    for setting, row in rows.items():
        if setting == "fp32" or fp32 is None:
            continue
        label = SETTINGS[setting]
        if fp32["eval_loss_mean"] is None:
            statements.append(f"{label}: no FP32 baseline to compare with (the FP32 runs failed).")
            continue
        found = verdict.curve_finding(records, setting)
        paired = found["paired"]
        row["paired"], row["finding"] = paired, found["finding"]
        row["paired_gaps"] = paired["gaps"]
        row["verdict"] = paired["verdict"]
        if paired["verdict"] == "diverged":
            statements.append(
                f"{label}: **diverged** (non-finite eval loss in seed(s) {paired['nonfinite_seeds']})."
            )
            continue
        if row["eval_loss_mean"] is None:
            statuses = ", ".join(sorted(set(row["statuses"])))
            statements.append(f"{label}: did not finish every run ({statuses}).")
            row["verdict"] = row["finding"] = "incomplete"
            continue
        gap = row["eval_loss_mean"] - fp32["eval_loss_mean"]
        # a loss whose FP32 mean is 0 (GRPO's eval loss can be) has no relative gap
        rel = gap / abs(fp32["eval_loss_mean"]) if fp32["eval_loss_mean"] != 0 else None
        row["gap"], row["relative_gap"] = gap, rel
        row["slowdown"] = verdict.steps_to_reach(records, setting)
        sentence = f"{label}: " + paired_text(paired, "eval loss")
        if floor is not None and setting != "dynamic" and floor["gaps"]:
            skips = sum(r.skipped_steps or 0 for r in by_setting["dynamic"])
            sentence += (
                f" Numerical floor (FP16 + dynamic's paired gaps): {_gaps(floor['gaps'])}."
                if not skips
                else f" FP16 + dynamic's paired gaps ({_gaps(floor['gaps'])}) include its {skips} skipped "
                "step(s), each of which costs a run its last learning-rate step: not a rounding-only floor."
            )
        spread = paired.get("seed_spread")
        shown_rel = f" ({rel:+.2%})" if rel is not None else ""
        sentence += f" Unpaired, for reference: mean gap {gap:+.4f}{shown_rel}" + (
            f" against the largest seed-to-seed spread {spread:.4f}." if spread is not None else "."
        )
        sentence += " " + slowdown_text(row["slowdown"]) + f" Finding: **{row['finding']}**."
        for metric in _accuracy_metrics(results):
            other = verdict.paired_verdict(records, setting, metric)
            row.setdefault("paired_metrics", {})[metric] = other
            sentence += f" {metric}: " + paired_text(other, metric)
        if setting == "dynamic" and rel is not None:
            within = abs(rel) <= 0.02
            row["within_2pct"] = within
            sentence += f" Within 2% of FP32: **{'yes' if within else 'no'}**."
        statements.append(sentence)
    off = rows.get("off")
    if off is not None and "finding" in off:
        statements.append(_failure_mode(off, [r for r in results if r.setting == "off"]))
    for r in results:
        if r.setting in ("static", "dynamic") and r.status == "collapsed":
            statements.append(
                f"{SETTINGS[r.setting]} (seed {r.seed}): **LossScaleCollapseError** — {r.error}"
            )
        elif r.setting == "static" and r.skipped_steps is not None:
            statements.append(
                f"{SETTINGS['static']} {scale_text(opts.static_scale)} (seed {r.seed}): skipped {r.skipped_steps} of "
                f"{r.total_steps or opts.max_steps} optimizer steps."
            )
    for r in left_out:
        reason = (r.error or "").strip().splitlines()
        statements.append(
            f"Left out of every verdict: {SETTINGS[r.setting]} seed {r.seed} ({r.status}"
            + (f", exit {r.returncode}" if r.returncode not in (0, None) else "")
            + (f": {reason[-1][:200]}" if reason else "")
            + "); it did not finish, so its last evaluation is no final one."
        )
    return {
        "rows": rows,
        "statements": statements,
        "rules": list(verdict.RULES.values()),
        "left_out": [{"setting": r.setting, "seed": r.seed, "status": r.status} for r in left_out],
    }


def _gaps(gaps: list[float]) -> str:
    return ", ".join(f"{g:+.4f}" for g in gaps)


def paired_text(paired: dict[str, Any], shown: str) -> str:
    """One sentence for a paired verdict (`hf_lossscale.tools.verdict.paired_verdict`)."""
    if paired["verdict"] == "no baseline":
        return f"no seed with both this setting and FP32 finished ({shown})."
    seeds = ", ".join(map(str, paired["seeds"]))
    text = f"paired {shown} gap to FP32 {_gaps(paired['gaps'])} (seed {seeds}), mean {paired['mean']:+.4f}"
    if "interval" in paired:
        low, high = paired["interval"]
        text += f", 95% interval [{low:+.4f}, {high:+.4f}]"
    if paired["verdict"] == "too few seeds":
        same = {"+": "the same sign (+) in every seed", "-": "the same sign (-) in every seed"}
        return (
            f"{text}; {same.get(paired['sign'], 'signs differ between seeds')}: **no verdict** with "
            f"{paired['n']} seed{'s' if paired['n'] != 1 else ''} (the paired rule needs {verdict.MIN_SEEDS})."
        )
    word = {"worse": "worse than FP32", "better": "better than FP32"}.get(
        paired["verdict"], paired["verdict"]
    )
    return f"{text}: **{word}** (paired rule, {paired['n']} seeds)."


def slowdown_text(slowdown: list[dict[str, Any]]) -> str:
    """Where each seed's eval curve first reaches FP32's final eval loss."""
    if not slowdown:
        return "Steps to FP32's final eval loss: not measured (no eval curve)."
    parts = []
    for s in slowdown:
        fp32_at = f"FP32 at {s['fp32_step']:.0f}"
        if s["step"] is None:
            more = (
                f"; FP32 reached this run's final loss by step {s['fp32_step_to_final']:.0f}: at least "
                f"{percent_change(s['at_least_extra'])} steps"
                if s.get("at_least_extra") is not None
                else ""
            )
            parts.append(f"seed {s['seed']}: not reached in {s['last_step']} steps ({fp32_at}{more})")
        else:
            parts.append(
                f"seed {s['seed']}: step {s['step']:.0f} ({fp32_at}, {percent_change(s['extra'])} steps)"
            )
    return "Steps to reach FP32's final eval loss: " + "; ".join(parts) + "."


def percent_change(fraction: float) -> str:
    """`+12%` / `-5%`; a difference that rounds to 0% reads `+0%` (never `-0%`)."""
    return f"{fraction:+.0%}" if round(100 * fraction) != 0 else "+0%"


def _accuracy_metrics(results: list[RunResult]) -> list[str]:
    """Final-eval metrics judged beside the loss: accuracy-like ones (perplexity follows the loss)."""
    return [m for m in _metric_columns(results) if verdict.higher_is_better(m)]


def _failure_mode(row: dict[str, Any], runs: list[RunResult]) -> str:
    """Say plainly what FP16 without loss scaling did, in the words of `verdict.RULES["curve"]`."""
    flushed = [
        r.flushed_end["flushed_fraction"] for r in runs if r.flushed_end and not r.flushed_end["overflow"]
    ]
    lost = (
        f", flushing {percent(min(flushed))}-{percent(max(flushed))} of gradient elements to zero by the end"
        if flushed
        else ""
    )
    finding = row["finding"]
    if finding == "diverged":
        return f"Without loss scaling, training **diverged**{lost}."
    if finding == "incomplete":
        return "Without loss scaling, not every run finished; see the status column."
    if finding == "stalled":
        return f"Without loss scaling, training **stalled**{lost}: no new best eval loss while FP32 still improved."
    if finding == "slowed":
        return f"Without loss scaling, training **slowed**{lost}: worse than FP32 by the paired rule, still improving; it did not diverge."
    if finding == "no measurable difference":
        return f"Without loss scaling: **no measurable difference** from FP32 by the paired rule{lost}; it did not diverge."
    if finding == "better":
        return f"Without loss scaling, eval loss came out **better** than FP32 by the paired rule{lost}."
    return (
        f"Without loss scaling, the runs finished with a finite loss{lost}; too few seeds for a paired verdict "
        f"(the rule needs {verdict.MIN_SEEDS})."
    )


def _metric_columns(results: list[RunResult]) -> list[str]:
    names: list[str] = []
    for r in results:
        for k, v in r.final_eval.items():
            if is_metric(k, v) and k not in names:
                names.append(k)
    return names


def write_summary(
    results: list[RunResult], summary: dict[str, Any], opts: argparse.Namespace, out: Path
) -> str:
    metrics = _metric_columns(results)
    fp16_kinds = sorted({r.fp16 for r in results if r.fp16})
    lines = [
        f"# Loss-scaling comparison: `{Path(opts.script).name}`",
        "",
        f"Command: `{opts.command_line}`",
        "",
        f"{opts.max_steps} optimizer steps per run; seeds {', '.join(map(str, opts.seeds))} (the same seed gives "
        "every setting the same data order and initial weights)"
        + (
            f"; {', '.join(SETTINGS[x] for x in opts.first_seed_only)} ran with seed {opts.seeds[0]} only."
            if getattr(opts, "first_seed_only", None)
            else "."
        ),
    ]
    if "emulated" in fp16_kinds:
        lines.append(
            "**FP16 was emulated on the CPU** (`fp16_emulation(policy='cuda')`: FP16 rounding, underflow and "
            "overflow at FP32 speed); these are not GPU measurements."
        )
    elif fp16_kinds:
        lines.append(f"FP16 ran as: {', '.join(fp16_kinds)}.")
    lines += [
        "",
        "Per seed, values are listed in seed order. *Flushed* = fraction of the non-zero FP32 gradient "
        "elements that are zero in FP16, on the run's first training batch against an FP32 pass of the "
        "same batch, at the scale in force at the start / the end of training.",
        "",
    ]
    head = ["Setting", "FP16", "eval loss", *metrics, "skipped steps", "final scale", "flushed (start)",
            "flushed (end)", "train time (s)", "status"]  # fmt: skip
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for setting in SETTINGS:
        runs = [r for r in results if r.setting == setting]
        if not runs:
            continue
        label = SETTINGS[setting] + (f" {scale_text(opts.static_scale)}" if setting == "static" else "")

        def per_seed(fn, runs=runs):
            return " / ".join(fn(r) for r in runs)

        cells = [
            label,
            per_seed(lambda r: r.fp16 or "—"),
            per_seed(lambda r: _num(r.eval_loss)),
            *[per_seed(lambda r, m=m: _num(r.final_eval.get(m))) for m in metrics],
            per_seed(
                lambda r: (
                    "—" if r.skipped_steps is None else f"{r.skipped_steps}/{r.total_steps or opts.max_steps}"
                )
            ),
            per_seed(lambda r: scale_text(r.final_scale)),
            per_seed(lambda r: fraction_text(r.flushed_start)),
            per_seed(lambda r: fraction_text(r.flushed_end)),
            per_seed(lambda r: _num(r.train_runtime_s, 1)),
            per_seed(lambda r: r.status),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *verdict_table(summary), "## What the runs show", ""]
    lines += [f"- {s}" for s in summary["statements"]] or ["- (no FP16 setting to compare)"]
    lines += ["", "## Rules", "", *[f"- {rule}" for rule in summary.get("rules", [])]]
    lines += [
        "",
        "Plots: `eval_loss.png` (eval loss vs step), `gap.png` (paired eval-loss gap to FP32 vs step, per seed; "
        "dynamic and off), "
        "`loss_scale.png` (scale vs step, skipped steps marked).",
        "",
    ]
    text = "\n".join(lines)
    atomic_write_text(out / "summary.md", text)
    return text


def verdict_table(summary: dict[str, Any]) -> list[str]:
    """The paired verdicts as a table: one row per FP16 setting."""
    judged = {k: v for k, v in summary["rows"].items() if "paired" in v and v["paired"]["gaps"]}
    if not judged:
        return []
    lines = [
        "## Paired verdicts (eval loss; rules below)",
        "",
        "| Setting | paired gap per seed | mean | 95% interval | verdict | finding | steps to FP32's final loss "
        "| unpaired gap / largest seed spread |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for setting, row in judged.items():
        p = row["paired"]
        interval = "[{:+.4f}, {:+.4f}]".format(*p["interval"]) if "interval" in p else "—"
        slow = ", ".join(
            percent_change(s["extra"])
            if s["step"] is not None
            else (
                f">= {percent_change(s['at_least_extra'])}"
                if s.get("at_least_extra") is not None
                else "not reached"
            )
            for s in row.get("slowdown", [])
        )
        spread = p.get("seed_spread")
        unpaired = (
            f"{row['gap']:+.4f} / " + ("—" if spread is None else f"{spread:.4f}") if "gap" in row else "—"
        )
        lines.append(
            f"| {SETTINGS[setting]} | {_gaps(p['gaps'])} | {p['mean']:+.4f} | {interval} | {p['verdict']} | "
            f"{row['finding']} | {slow or '—'} | {unpaired} |"
        )
    return [*lines, ""]


def scale_text(scale: float | None) -> str:
    """A loss scale as `2^k` when it is a power of two (they usually are), else as a number."""
    if scale is None:
        return "—"
    if scale > 0 and math.isfinite(scale) and math.log2(scale).is_integer():
        return f"2^{int(math.log2(scale))}"
    return f"{scale:g}"


def _num(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}f}" if math.isfinite(value) else str(value)
