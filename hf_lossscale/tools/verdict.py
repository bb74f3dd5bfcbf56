"""Paired verdicts: what an FP16 setting did against FP32, judged per seed.

Settings run with the same seed share the data order and the initial weights, so the gap
`setting - FP32` *at the same seed* is the effect of the setting itself; the spread between seeds
is mostly each seed's own data order and weights, and cancels in that difference. The verdict
therefore rests on the paired gaps, and every rule is written out next to it (`RULES`).

Works on plain run records (dicts with `setting`, `seed`, `status`, `final_eval` and `evals`: a
list of `{"step": ..., "eval_loss": ..., ...}`), the shape `hf-lossscale compare` writes to
`metrics.json` and `benchmarks/reproduce` keeps in `results/*.json`. Standard library only.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "MIN_SEEDS",
    "RULES",
    "higher_is_better",
    "paired_verdict",
    "steps_to_reach",
    "curve_finding",
    "gap_curves",
    "t_quantile_975",
]

#: Seeds a verdict of "worse", "better" or "no measurable difference" needs.
MIN_SEEDS = 3
#: Evaluations without improvement that make a run "stalled".
STALL_EVALS = 3
#: An eval loss this far (relative) above the run's best, at the end, makes it "diverged".
DIVERGE_RISE = 0.05
#: A curve within this (relative) of the target has reached it: FP16 rounding alone moves a final
#: loss by about 1e-4 relative, which must not read as "not reached".
REACH_TOLERANCE = 1e-3

RULES = {
    "paired": (
        f"Paired rule: for each seed, gap = setting - FP32 at that seed (same data order, same initial "
        f"weights). With at least {MIN_SEEDS} seeds, the setting is **worse** (or **better**) than FP32 when the "
        "95% Student-t interval of the mean paired gap (n-1 degrees of freedom) lies wholly on that side of 0, "
        f"and shows **no measurable difference** when it contains 0. With fewer than {MIN_SEEDS} seeds no verdict "
        "is given, only the gaps. The unpaired figure (mean gap against the largest seed-to-seed spread) is "
        "shown for reference, not used. FP16 + dynamic scaling's paired gaps are the numerical floor (what FP16 "
        "rounding alone does) when it skipped no step: a skipped step costs a run one learning-rate step."
    ),
    "slowdown": (
        "Slowdown: the step at which a run's eval curve first reaches FP32's final eval loss at the same seed "
        f"(within {REACH_TOLERANCE:.1%}; linear interpolation between evaluations), against the step at which "
        "FP32 itself first reaches it; 'not reached' when it never does within the run, and then the step at "
        "which FP32 reached the run's own final eval loss: the run needed at least last step / that step - 1 more "
        "steps."
    ),
    "curve": (
        f"Words for the curve: **diverged** = a non-finite eval loss (or a run that ends on a non-finite "
        f"training loss), or an eval loss that ends more than "
        f"{DIVERGE_RISE:.0%} above the run's best; **stalled** = no new best eval loss over the last "
        f"{STALL_EVALS} evaluations while FP32 at the same seed still improved over them (in most seeds); "
        "**slowed** = "
        "worse than FP32 by the paired rule while still improving; **no measurable difference** = the paired "
        "interval contains 0."
    ),
}

# Two-sided 95% Student-t quantiles (t_{0.975, df}) for df = 1..30; beyond, the normal's 1.96 + a
# first-order correction is within 0.1% of the exact value.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)  # fmt: skip


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom."""
    if df < 1:
        raise ValueError(f"df must be at least 1, got {df}.")
    if df <= len(_T975):
        return _T975[df - 1]
    return 1.959964 + 2.37 / df


def higher_is_better(metric: str) -> bool:
    """Losses and perplexities fall as a model improves; accuracy-like metrics rise."""
    return not any(word in metric for word in ("loss", "perplexity"))


def _get(run: Any, key: str) -> Any:
    return run[key] if isinstance(run, Mapping) else getattr(run, key)


def _final(run: Any, metric: str) -> float | None:
    value = (_get(run, "final_eval") or {}).get(metric)
    return None if value is None else float(value)


def _by_seed(runs: Iterable[Any], setting: str) -> dict[int, Any]:
    return {_get(r, "seed"): r for r in runs if _get(r, "setting") == setting}


def paired_verdict(
    runs: list[Any],
    setting: str,
    metric: str = "eval_loss",
    baseline: str = "fp32",
    higher_better: bool | None = None,
) -> dict[str, Any]:
    """The paired comparison of `setting` with FP32 (or another `baseline` setting, e.g. BF16 against
    FP16 + dynamic scaling) on `metric` (see `RULES["paired"]`).

    Returns a dict with `gaps` (per seed, setting - FP32, in seed order), `seeds`, `n`, `mean`,
    `sd`, `interval` (95% t-interval, n >= 2), `sign` ("+"/"-"/"mixed"), `verdict` ("worse",
    "better", "no measurable difference", "too few seeds", "no baseline" or "diverged"), and the
    unpaired reference `unpaired_gap` / `seed_spread`. `higher_better` says which side is worse
    (default: from the metric's name, `higher_is_better`).
    """
    fp32, other = _by_seed(runs, baseline), _by_seed(runs, setting)
    out: dict[str, Any] = {"setting": setting, "metric": metric, "gaps": [], "seeds": [], "n": 0}
    nonfinite = [s for s, r in other.items() if (v := _final(r, metric)) is not None and not math.isfinite(v)]
    if nonfinite:
        out.update(verdict="diverged", nonfinite_seeds=sorted(nonfinite))
        return out
    for seed in sorted(other):
        a, b = _final(other[seed], metric), _final(fp32[seed], metric) if seed in fp32 else None
        if a is not None and b is not None and math.isfinite(b):
            out["gaps"].append(a - b)
            out["seeds"].append(seed)
    gaps = out["gaps"]
    n = out["n"] = len(gaps)
    finals = {s: [v for r in group.values() if (v := _final(r, metric)) is not None and math.isfinite(v)]
              for s, group in (("fp32", fp32), (setting, other))}  # fmt: skip
    if finals["fp32"] and finals[setting]:
        out["unpaired_gap"] = statistics.fmean(finals[setting]) - statistics.fmean(finals["fp32"])
        spreads = [max(v) - min(v) for v in finals.values() if len(v) >= 2]
        out["seed_spread"] = max(spreads) if spreads else None
    if n == 0:
        out["verdict"] = "no baseline"
        return out
    out["mean"] = statistics.fmean(gaps)
    out["sign"] = "+" if all(g > 0 for g in gaps) else "-" if all(g < 0 for g in gaps) else "mixed"
    # Sign test, two-sided: the chance that n fair coins all land the same way.
    out["sign_test_p"] = min(1.0, 2 * 0.5**n) if out["sign"] != "mixed" else None
    if n >= 2:
        out["sd"] = statistics.stdev(gaps)
        half = t_quantile_975(n - 1) * out["sd"] / math.sqrt(n)
        out["interval"] = (out["mean"] - half, out["mean"] + half)
    if n < MIN_SEEDS:
        out["verdict"] = "too few seeds"
        return out
    low, high = out["interval"]
    higher_better = higher_is_better(metric) if higher_better is None else higher_better
    worse_side = (lambda lo, hi: hi < 0) if higher_better else (lambda lo, hi: lo > 0)
    if low <= 0 <= high:
        out["verdict"] = "no measurable difference"
    else:
        out["verdict"] = "worse" if worse_side(low, high) else "better"
    return out


def _crossing(points: list[tuple[int, float]], target: float, lower: bool) -> float | None:
    """The first step at which the curve reaches `target` (linear between points)."""
    reached = (lambda v: v <= target) if lower else (lambda v: v >= target)
    for i, (step, value) in enumerate(points):
        if reached(value):
            if i == 0:
                return float(step)
            s0, v0 = points[i - 1]
            return s0 + (step - s0) * (target - v0) / (value - v0) if value != v0 else float(step)
    return None


def _curve(run: Any, metric: str) -> list[tuple[int, float]]:
    return [(int(e["step"]), float(e[metric])) for e in (_get(run, "evals") or []) if metric in e]


def steps_to_reach(runs: list[Any], setting: str, metric: str = "eval_loss") -> list[dict[str, Any]]:
    """Per seed: the step at which `setting` first reaches FP32's final `metric` at that seed, the
    step at which FP32 does, and `extra` = setting / FP32 - 1 (None when not reached); see
    `RULES["slowdown"]`."""
    fp32, other = _by_seed(runs, "fp32"), _by_seed(runs, setting)
    lower = not higher_is_better(metric)
    out = []
    for seed in sorted(set(fp32) & set(other)):
        base, curve = _curve(fp32[seed], metric), _curve(other[seed], metric)
        target = _final(fp32[seed], metric)
        if not base or not curve or target is None:
            continue
        target += abs(target) * REACH_TOLERANCE * (1 if lower else -1)
        own, theirs = _crossing(base, target, lower), _crossing(curve, target, lower)
        # The other way round: where FP32 reached this run's final value. A run that never reaches
        # FP32's final loss needed its whole length for what FP32 did by then.
        final = curve[-1][1]
        equal = _crossing(base, final + abs(final) * REACH_TOLERANCE * (1 if lower else -1), lower)
        out.append({
            "seed": seed, "target": _final(fp32[seed], metric), "fp32_step": own, "step": theirs,
            "last_step": curve[-1][0], "extra": (theirs / own - 1) if theirs is not None and own else None,
            "fp32_step_to_final": equal,
            "at_least_extra": (curve[-1][0] / equal - 1) if theirs is None and equal else None,
        })  # fmt: skip
    return out


def gap_curves(
    runs: list[Any], setting: str, metric: str = "eval_loss"
) -> dict[int, list[tuple[int, float]]]:
    """Per seed: `[(step, setting - FP32 at that step), ...]` at every evaluation both runs made."""
    fp32, other = _by_seed(runs, "fp32"), _by_seed(runs, setting)
    out = {}
    for seed in sorted(set(fp32) & set(other)):
        base = dict(_curve(fp32[seed], metric))
        out[seed] = [(s, v - base[s]) for s, v in _curve(other[seed], metric) if s in base]
    return out


def _improving(points: list[tuple[int, float]], lower: bool) -> bool:
    """Whether the last `STALL_EVALS` evaluations made a new best."""
    if len(points) <= STALL_EVALS:
        return True  # too short to call it stalled
    values = [v if lower else -v for _, v in points]
    return min(values[-STALL_EVALS:]) < min(values[:-STALL_EVALS])


def curve_finding(runs: list[Any], setting: str, metric: str = "eval_loss") -> dict[str, Any]:
    """One word for what `setting` did, from the paired verdict and the eval curves (see
    `RULES["curve"]`): "diverged", "stalled", "slowed", "no measurable difference", "better", or
    "undecided" (too few seeds), with the seeds behind it."""
    verdict = paired_verdict(runs, setting, metric)
    lower = not higher_is_better(metric)
    fp32, other = _by_seed(runs, "fp32"), _by_seed(runs, setting)
    diverged, stalled = [], []
    for seed, run in sorted(other.items()):
        curve = _curve(run, metric)
        values = [v for _, v in curve]
        final = _final(run, metric)
        if (final is not None and not math.isfinite(final)) or any(not math.isfinite(v) for v in values):
            diverged.append(seed)
            continue
        train = run.get("train_loss") if isinstance(run, Mapping) else getattr(run, "train_loss", None)
        if train and not math.isfinite(train[-1]):  # one skipped overflow is not divergence; ending on one is
            diverged.append(seed)
            continue
        if lower and values and values[-1] > min(values) * (1 + DIVERGE_RISE):
            diverged.append(seed)
            continue
        if seed in fp32 and not _improving(curve, lower) and _improving(_curve(fp32[seed], metric), lower):
            stalled.append(seed)
    if diverged:
        word = "diverged"
    elif stalled and len(stalled) * 2 > len(other):
        word = "stalled"
    elif verdict["verdict"] == "worse":
        word = "slowed"
    elif verdict["verdict"] in ("no measurable difference", "better"):
        word = verdict["verdict"]
    else:
        word = "undecided"
    return {"finding": word, "diverged_seeds": diverged, "stalled_seeds": stalled, "paired": verdict}
