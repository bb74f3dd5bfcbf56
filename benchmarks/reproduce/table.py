"""The README's results tables, rendered from `results/<benchmark>.json` (written by `run.py`).

`python benchmarks/reproduce/run.py table` prints them; `--write` replaces the block between the
`<!-- results:start -->` and `<!-- results:end -->` markers of README.md with them.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from hf_lossscale.compare import SETTINGS, percent, scale_text

LABELS = {**SETTINGS, "static": f"{SETTINGS['static']} 2^24"}  # the benchmarks' static scale
START, END = "<!-- results:start -->", "<!-- results:end -->"
HEADLINE = "<!-- headline:start -->", "<!-- headline:end -->"


def headline(result: dict) -> str:
    """The metric a benchmark is judged by: accuracy where the runs report it, else eval loss."""
    runs = [r for r in result["runs"] if r["status"] == "ok"]
    if runs and "eval_accuracy" in runs[0]["final_eval"]:
        return "eval_accuracy"
    return "eval_loss"


def _values(result: dict, setting: str, metric: str) -> list[float]:
    return [
        r["final_eval"][metric]
        for r in sorted(result["runs"], key=lambda r: r["seed"])
        if r["setting"] == setting and r["status"] == "ok" and metric in r["final_eval"]
    ]


def verdicts(result: dict) -> list[dict]:
    """Each FP16 setting's mean gap to FP32 on the headline metric, against FP32's seed spread.

    Accuracy is judged in points with a floor of 1 point (the issue's target: within FP32's
    seed-to-seed spread or 1 point, whichever is wider); a loss against the largest seed spread
    of any setting, as `hf-lossscale compare` does."""
    metric = headline(result)
    fp32 = _values(result, "fp32", metric)
    out = []
    if not fp32:
        return out
    spreads = [max(v) - min(v) for s in LABELS if len(v := _values(result, s, metric)) > 1]
    if metric == "eval_accuracy":
        fp32_spread = max(fp32) - min(fp32) if len(fp32) > 1 else 0.0
        bound, bound_text = max(fp32_spread, 0.01), "max(FP32 seed spread, 1 point)"
    else:
        bound, bound_text = (max(spreads) if spreads else 0.0), "largest seed spread"
    for setting in ("dynamic", "static", "off"):
        values = _values(result, setting, metric)
        if not values:
            continue
        gap = statistics.fmean(values) - statistics.fmean(fp32)
        out.append({"setting": setting, "metric": metric, "gap": gap, "bound": bound,
                    "bound_text": bound_text, "within": abs(gap) <= bound, "n": len(values)})  # fmt: skip
    return out


def _pct(x: float | None) -> str:
    return "—" if x is None else percent(x)


def _fmt(metric: str, v: float) -> str:
    return f"{100 * v:.2f}" if metric == "eval_accuracy" else f"{v:.4f}"


def render(result: dict) -> str:
    metric = headline(result)
    shown = "accuracy (%)" if metric == "eval_accuracy" else "eval loss"
    lines = [
        f"### `{result['benchmark']}`: {result['what']}",
        "",
        f"`{result.get('run_command', result['command'])}` on {result['machine']}; the runs took "
        f"{sum(r['wall_s'] for r in result['runs']) / 60:.0f} min in all. The `hf-lossscale compare` command it "
        f"runs is in `results/{result['benchmark']}.json`.",
        "",
        f"| Setting | FP16 | seed | {shown} | "
        + ("eval loss | " if metric != "eval_loss" else "perplexity | ")
        + "skipped steps | final scale | flushed (start) | flushed (end) | run wall time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {s: i for i, s in enumerate(LABELS)}
    for r in sorted(result["runs"], key=lambda r: (order.get(r["setting"], 9), r["seed"])):
        ev = r["final_eval"]
        value = _fmt(metric, ev[metric]) if metric in ev else r["status"]
        second = (f"{ev['eval_loss']:.4f}" if "eval_loss" in ev else "—") if metric != "eval_loss" else (
            f"{math.exp(ev['eval_loss']):.1f}" if "eval_loss" in ev else "—")  # fmt: skip
        skipped = "—" if r["skipped_steps"] is None else f"{r['skipped_steps']}/{r['total_steps']}"
        flushed_start = "overflow" if r.get("overflow_start") else _pct(r["flushed_start"])
        flushed_end = "overflow" if r.get("overflow_end") else _pct(r["flushed_end"])
        lines.append(
            f"| {LABELS.get(r['setting'], r['setting'])} | {r['fp16'] or '—'} | {r['seed']} | {value} | {second} | "
            f"{skipped} | {scale_text(r['final_scale'])} | {flushed_start} | {flushed_end} | "
            f"{r['wall_s'] / 60:.1f} min |"
        )
    lines.append("")
    fp32 = _values(result, "fp32", metric)
    if fp32:
        lines.append(f"FP32 {shown}: {' / '.join(_fmt(metric, v) for v in fp32)} "
                     f"(seed spread {_fmt(metric, max(fp32) - min(fp32))}).")  # fmt: skip
    for v in verdicts(result):
        word = "within" if v["within"] else "outside"
        lines.append(
            f"- {LABELS[v['setting']]}: mean {shown} {'+' if v['gap'] >= 0 else ''}{_fmt(metric, v['gap'])} vs FP32 "
            f"({v['n']} seed{'s' if v['n'] > 1 else ''}); **{word}** {v['bound_text']} = {_fmt(metric, v['bound'])}."
        )
    return "\n".join(lines) + "\n"


def render_tables(folder: Path) -> str:
    files = sorted(Path(folder).glob("*.json"), key=lambda p: (p.stem != "sst2", p.stem))
    if not files:
        return "(no results yet: run `python benchmarks/reproduce/run.py <benchmark>`)\n"
    return "\n".join(render(json.loads(p.read_text())) for p in files)


def render_headline(folder: Path) -> str:
    """One row per benchmark for the project README: each setting's headline metric per seed."""
    lines = [
        "| benchmark | metric | FP32 | FP16 + dynamic scaling | FP16, scaling off | FP16 + static 2^24 |",
        "|---|---|---|---|---|---|",
    ]
    files = sorted(Path(folder).glob("*.json"), key=lambda p: (p.stem != "sst2", p.stem))
    for path in files:
        result = json.loads(path.read_text())
        metric = headline(result)
        cells = []
        for setting in ("fp32", "dynamic", "off", "static"):
            values = _values(result, setting, metric)
            runs = [r for r in result["runs"] if r["setting"] == setting]
            cell = " / ".join(_fmt(metric, v) for v in values) or "—"
            if setting != "fp32" and runs:
                skipped = sum(r["skipped_steps"] or 0 for r in runs)
                total = sum(r["total_steps"] or 0 for r in runs)
                if skipped:
                    cell += f" ({skipped}/{total} steps skipped)"
            verdict = next((v for v in verdicts(result) if v["setting"] == setting), None)
            if verdict and setting != "static":
                cell += " ✓" if verdict["within"] else " ✗"
            cells.append(cell)
        shown = "accuracy %" if metric == "eval_accuracy" else "eval loss"
        lines.append(f"| `{result['benchmark']}` | {shown} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Values per seed (seeds 0 / 1). ✓: the mean is within noise of FP32's — for accuracy within FP32's "
        "seed-to-seed spread or 1 point, whichever is wider; for a loss within the largest seed-to-seed spread "
        "of any setting. ✗: outside it.",
    ]
    return "\n".join(lines) + "\n"


def write_readme(readme: Path, tables: str, start: str = START, end: str = END) -> None:
    """Replace the block between `start` and `end` in `readme` with `tables`."""
    text = readme.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"{readme} has no {start} ... {end} block to replace.")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n\n{tables}\n{end}{tail}")
