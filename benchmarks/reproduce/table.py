"""The README's results tables, rendered from `results/<benchmark>.json` (written by `run.py`).

`python benchmarks/reproduce/run.py table` prints them; `--write` replaces the block between the
`<!-- results:start -->` and `<!-- results:end -->` markers of README.md with them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from hf_lossscale.tools import verdict
from hf_lossscale.tools.runs import SETTINGS
from hf_lossscale.tools.summary import percent, percent_change, scale_text

LABELS = {
    **SETTINGS,
    "static": f"{SETTINGS['static']} 2^24",  # the benchmarks' static scale
    "fp32_divided": "FP32, gradients divided",  # a simulated benchmark's own FP32 (see `load`)
}
START, END = "<!-- results:start -->", "<!-- results:end -->"
HEADLINE = "<!-- headline:start -->", "<!-- headline:end -->"
MASTERS = "<!-- masters:start -->", "<!-- masters:end -->"


def on_gpu(result: dict) -> bool:
    """Whether a results file's runs ran on a GPU: some run's FP16 was CUDA's."""
    return any(r.get("fp16") == "cuda" for r in result["runs"])


def load(path: Path) -> dict:
    """A results file, ready to render. A simulated benchmark (run.py's `fp32_from`: gradients
    divided by `--loss_divisor`, which leaves FP32's updates as they were) is judged against the
    FP32 runs of the benchmark it simulates, at the same seeds; its own FP32 runs, where made, become
    `fp32_divided` and are compared with those (what the divisor changes: only the clip's 1e-6 term)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from suite import BENCHMARKS  # beside this file

    result = json.loads(Path(path).read_text())
    source = BENCHMARKS.get(result["benchmark"], {}).get("fp32_from")
    base = Path(path).with_name(f"{source}.json") if source else None
    if base is None or not base.is_file():
        return result
    own = [dict(r, setting="fp32_divided") if r["setting"] == "fp32" else r for r in result["runs"]]
    borrowed = [
        dict(r, borrowed_from=source) for r in json.loads(base.read_text())["runs"] if r["setting"] == "fp32"
    ]
    seeds = {r["seed"] for r in own}
    return {**result, "runs": own + [r for r in borrowed if r["seed"] in seeds], "fp32_from": source}


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
    """Each FP16 setting's paired verdict against FP32 on the headline metric (the rule:
    `hf_lossscale.tools.verdict.RULES`), with the curve finding, the steps to FP32's final eval loss and
    the perplexity ratio where the metric is a loss."""
    metric = headline(result)
    runs = [r for r in result["runs"] if r["status"] == "ok"]
    if not any(r["setting"] == "fp32" for r in runs):
        return []
    out = []
    for setting in ("dynamic", "static", "off", "bf16", "master", "kahan", "stochastic", "pure"):
        if not any(r["setting"] == setting for r in runs):
            continue
        found = verdict.curve_finding(runs, setting, metric)
        entry = {"setting": setting, "metric": metric, **found["paired"], "finding": found["finding"]}
        if metric == "eval_loss" and entry["gaps"]:
            entry["slowdown"] = verdict.steps_to_reach(runs, setting)
            entry["perplexity_ratio"] = [math.exp(g) for g in entry["gaps"]]
        out.append(entry)
    return out


def bf16_against_dynamic(result: dict) -> dict | None:
    """BF16's paired comparison with FP16 + dynamic scaling (same seeds): the choice a user makes."""
    metric = headline(result)
    runs = [r for r in result["runs"] if r["status"] == "ok"]
    if not all(any(r["setting"] == s for r in runs) for s in ("bf16", "dynamic")):
        return None
    return verdict.paired_verdict(runs, "bf16", metric, baseline="dynamic")


def _gaps_and_word(v: dict, words: dict | None = None) -> tuple[str, str, str]:
    """A paired verdict's gaps, its interval text (or "") and its verdict word."""
    gaps = ", ".join(_fmt(v["metric"], g, signed=True) for g in v["gaps"])
    interval = ""
    if "interval" in v:
        low, high = v["interval"]
        interval = (
            f", 95% interval [{_fmt(v['metric'], low, signed=True)}, {_fmt(v['metric'], high, signed=True)}]"
        )
    word = (words or {}).get(v["verdict"], v["verdict"])
    if v["verdict"] == "too few seeds":
        word = f"no verdict ({v['n']} seed{'s' if v['n'] > 1 else ''}; the rule needs {verdict.MIN_SEEDS})"
    return gaps, interval, word


def bf16_line(v: dict, shown: str) -> str:
    """The statement of `bf16_against_dynamic`: which of the two is worse, and by how much."""
    gaps, interval, word = _gaps_and_word(v, {"worse": "BF16 worse", "better": "BF16 better"})
    return f"- BF16 against FP16 + dynamic scaling: paired {shown} gap (BF16 - FP16) {gaps}{interval}: **{word}**."


def verdict_line(v: dict, shown: str) -> str:
    """One line of the benchmark's statements: the paired verdict, its interval, and the finding."""
    gaps, interval, word = _gaps_and_word(v)
    seeds = f"seed{'s' if v['n'] > 1 else ''} {', '.join(map(str, v['seeds']))}"
    line = f"- {LABELS[v['setting']]}: paired {shown} gap to FP32 {gaps} ({seeds}){interval}"
    line += f": **{word}**; finding: **{v['finding']}**."
    if v.get("perplexity_ratio"):
        line += " Perplexity ratio to FP32: " + ", ".join(f"{x:.3f}" for x in v["perplexity_ratio"]) + "."
    if v.get("slowdown"):
        parts = [_reach_text(s) for s in v["slowdown"]]
        line += " Reaches FP32's final eval loss: " + "; ".join(parts) + "."
    return line


def _pct(x: float | None) -> str:
    return "—" if x is None else percent(x)


def _fmt(metric: str, v: float, signed: bool = False) -> str:
    sign = "+" if signed else ""
    return f"{100 * v:{sign}.2f}" if metric == "eval_accuracy" else f"{v:{sign}.4f}"


def _reach_text(s: dict) -> str:
    if s["step"] is not None:
        return f"step {s['step']:.0f} ({percent_change(s['extra'])})"
    if s.get("at_least_extra") is None:
        return f"not reached in {s['last_step']} steps"
    return (
        f"not reached in {s['last_step']} steps (FP32 reached this run's final loss by step "
        f"{s['fp32_step_to_final']:.0f}: at least {percent_change(s['at_least_extra'])} steps)"
    )


def render(result: dict) -> str:
    metric = headline(result)
    shown = "accuracy (%)" if metric == "eval_accuracy" else "eval loss"
    lines = [
        f"### `{result['benchmark']}`: {result['what']}",
        "",
        f"`{result.get('run_command', result['command'])}` on {result['machine']}; the runs took "
        f"{sum(r['wall_s'] for r in result['runs'] if 'borrowed_from' not in r) / 60:.0f} min in all. The `hf-lossscale compare` command it "
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
        spread = f" (seed spread {_fmt(metric, max(fp32) - min(fp32))})" if len(fp32) > 1 else ""
        lines.append(f"FP32 {shown}: {' / '.join(_fmt(metric, v) for v in fp32)}{spread}.")
    if result.get("fp32_from"):
        lines.append(
            f"FP32 is `{result['fp32_from']}`'s (the same seeds, the same updates: the divisor divides AdamW's "
            "epsilon and the clip threshold with the gradients)."
        )
        fidelity = verdict.paired_verdict(
            [r for r in result["runs"] if r["status"] == "ok"], "fp32_divided", metric
        )
        if fidelity["n"]:
            gaps, interval, _ = _gaps_and_word(fidelity)
            lines.append(
                f"- {LABELS['fp32_divided']} against it (what the divisor itself changes): {gaps}{interval}."
            )
    lines += [verdict_line(v, shown) for v in verdicts(result)]
    against = bf16_against_dynamic(result)
    if against is not None and against["n"]:
        lines.append(bf16_line(against, shown))
    return "\n".join(lines) + "\n"


def render_tables(folder: Path) -> str:
    files = sorted(Path(folder).glob("*.json"), key=lambda p: (p.stem != "sst2", p.stem))
    if not files:
        return "(no results yet: run `python benchmarks/reproduce/run.py <benchmark>`)\n"
    return "\n".join(render(load(p)) for p in files)


def render_headline(folder: Path) -> str:
    """One row per benchmark run on this CPU, for the project README: each setting's headline metric
    per seed (the static 2^24 column only when some benchmark ran it). GPU runs: `render_masters`."""
    files = sorted(Path(folder).glob("*.json"), key=lambda p: (p.stem != "sst2", p.stem))
    results = [r for r in map(load, files) if not on_gpu(r)]
    # comparisons of FP16 weights alone (FP32 against masters, Kahan, ...) are `render_masters`' rows
    fp16_weights = ("master", "kahan", "stochastic", "pure")
    results = [
        r
        for r in results
        if not all(x["setting"] in ("fp32", *fp16_weights) for x in r["runs"])
        or not any(x["setting"] in fp16_weights for x in r["runs"])
    ]
    settings = ["fp32", "dynamic", "off"]
    for extra in ("static", "bf16"):  # a column only where some benchmark ran the setting
        if any(r["setting"] == extra for result in results for r in result["runs"]):
            settings.append(extra)
    return _headline_table(results, settings)


def render_masters(folder: Path) -> str:
    """The benchmarks that ran FP16 weights (with FP32 masters, and without): FP32, autocast FP16 with
    dynamic scaling, FP16 weights + masters, FP16 weights alone, per seed, with where they ran."""
    files = sorted(Path(folder).glob("*.json"), key=lambda p: (p.stem != "sst2", p.stem))
    results = [
        r
        for r in map(load, files)
        if any(x["setting"] in ("master", "kahan", "stochastic", "pure") for x in r["runs"])
    ]
    settings = [
        s
        for s in ("fp32", "dynamic", "master", "kahan", "stochastic", "pure")
        if any(x["setting"] == s for r in results for x in r["runs"])
    ]
    where = sorted({r["machine"] for r in results})
    return _headline_table(results, settings) + f"\nRan on: {'; '.join(where) or 'nothing yet'}.\n"


def _headline_table(results: list[dict], settings: list[str]) -> str:
    header = ["benchmark", "metric", *(LABELS[s] for s in settings)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for result in results:
        metric = headline(result)
        cells = []
        for setting in settings:
            values = _values(result, setting, metric)
            runs = [r for r in result["runs"] if r["setting"] == setting]
            cell = " / ".join(_fmt(metric, v) for v in values) or "—"
            if setting != "fp32" and runs:
                skipped = sum(r["skipped_steps"] or 0 for r in runs)
                total = sum(r["total_steps"] or 0 for r in runs)
                if skipped:
                    cell += f" ({skipped}/{total} steps skipped)"
            found = next((v for v in verdicts(result) if v["setting"] == setting), None)
            if found and setting != "static":
                cell += f" ({_word(found)})"
            cells.append(cell)
        shown = "accuracy %" if metric == "eval_accuracy" else "eval loss"
        lines.append(f"| `{result['benchmark']}` | {shown} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Values per seed, in seed order. In brackets, the finding against FP32 by the paired rule: "
        + verdict.RULES["paired"]
        + " "
        + verdict.RULES["curve"],
    ]
    return "\n".join(lines) + "\n"


def _word(v: dict) -> str:
    if v["verdict"] == "too few seeds":
        return f"{v['n']} seed{'s' if v['n'] != 1 else ''}: no verdict"
    return v["finding"]


def write_readme(readme: Path, tables: str, start: str = START, end: str = END) -> None:
    """Replace the block between `start` and `end` in `readme` with `tables`."""
    text = readme.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"{readme} has no {start} ... {end} block to replace.")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n\n{tables}\n{end}{tail}")
