"""Paired verdicts on hand-built results, chosen where the paired and the unpaired rule disagree."""

import math

import pytest

from hf_lossscale.tools import verdict


def run(setting, seed, final, curve=None, metric="eval_loss", **kw):
    evals = [{"step": s, metric: v} for s, v in (curve or [])]
    return {
        "setting": setting,
        "seed": seed,
        "status": "ok",
        "final_eval": {metric: final},
        "evals": evals,
        **kw,
    }


def test_consistent_small_gap_is_worse_although_seeds_spread_wider():
    """+0.07..+0.10 at every seed against a 0.5 seed-to-seed spread: the demo's old 'within noise'.
    A rule that judged the mean gap against the seed spread would call this within noise."""
    fp32 = {0: 6.0, 1: 6.3, 2: 5.8}
    gaps = {0: 0.07, 1: 0.10, 2: 0.09}
    runs = [run("fp32", s, v) for s, v in fp32.items()] + [
        run("off", s, fp32[s] + g) for s, g in gaps.items()
    ]
    v = verdict.paired_verdict(runs, "off")
    assert v["verdict"] == "worse"
    assert v["gaps"] == pytest.approx([0.07, 0.10, 0.09]) and v["seeds"] == [0, 1, 2]
    assert v["interval"][0] > 0
    assert abs(v["unpaired_gap"]) < v["seed_spread"]  # the unpaired rule would have said "within noise"


def test_inconsistent_gaps_are_no_measurable_difference_although_the_mean_is_outside_the_spread():
    """Gaps +0.25, +0.05, +0.25: the mean (0.18) is above every seed spread (at most 0.15), but three
    paired gaps that vary this much do not pin the effect away from 0 (t interval ~[-0.10, +0.47])."""
    fp32 = {0: 6.00, 1: 6.10, 2: 6.05}
    off = {0: 6.25, 1: 6.15, 2: 6.30}
    runs = [run("fp32", s, v) for s, v in fp32.items()] + [run("off", s, v) for s, v in off.items()]
    v = verdict.paired_verdict(runs, "off")
    assert v["unpaired_gap"] > v["seed_spread"]
    assert v["verdict"] == "no measurable difference"
    low, high = v["interval"]
    mean, sd = sum([0.25, 0.05, 0.25]) / 3, math.sqrt(((0.25 - 0.1833) ** 2 * 2 + (0.05 - 0.1833) ** 2) / 2)
    assert low == pytest.approx(mean - 4.303 * sd / math.sqrt(3), abs=1e-3) and low < 0 < high


def test_two_seeds_give_no_verdict_only_the_gaps():
    runs = [run("fp32", 0, 6.0), run("fp32", 1, 6.1), run("off", 0, 6.5), run("off", 1, 6.6)]
    v = verdict.paired_verdict(runs, "off")
    assert v["verdict"] == "too few seeds" and v["n"] == 2 and v["sign"] == "+"
    assert v["sign_test_p"] == pytest.approx(0.5)


def test_accuracy_is_judged_with_its_own_direction():
    fp32 = {0: 0.90, 1: 0.88, 2: 0.91}
    lower = [run("fp32", s, v, metric="eval_accuracy") for s, v in fp32.items()]
    lower += [
        run("off", s, v - d, metric="eval_accuracy") for (s, v), d in zip(fp32.items(), (0.02, 0.03, 0.025))
    ]
    assert verdict.paired_verdict(lower, "off", "eval_accuracy")["verdict"] == "worse"
    higher = [dict(r, final_eval={"eval_accuracy": r["final_eval"]["eval_accuracy"] + (0.05 if r["setting"] == "off" else 0)})
              for r in lower]  # fmt: skip
    assert verdict.paired_verdict(higher, "off", "eval_accuracy")["verdict"] == "better"


def test_non_finite_final_loss_is_diverged():
    runs = [run("fp32", 0, 6.0), run("off", 0, float("nan"), [(10, 7.0), (20, float("nan"))])]
    assert verdict.paired_verdict(runs, "off")["verdict"] == "diverged"
    assert verdict.curve_finding(runs, "off")["finding"] == "diverged"


def test_steps_to_reach_interpolates_and_says_not_reached():
    base = [(10, 5.0), (20, 4.0), (30, 3.5)]
    runs = [
        run("fp32", 0, 3.5, base),
        run("fast", 0, 2.9, [(10, 4.5), (20, 3.0), (30, 2.9)]),
        run("slow", 0, 3.8, [(10, 5.2), (20, 4.2), (30, 3.8)]),
    ]
    (fast,) = verdict.steps_to_reach(runs, "fast")
    target = 3.5 * (1 + verdict.REACH_TOLERANCE)  # within the tolerance of FP32's final loss
    assert fast["fp32_step"] == pytest.approx(20 + 10 * (target - 4.0) / (3.5 - 4.0))
    assert fast["step"] == pytest.approx(10 + 10 * (target - 4.5) / (3.0 - 4.5))
    assert fast["extra"] == pytest.approx(fast["step"] / fast["fp32_step"] - 1)
    (slow,) = verdict.steps_to_reach(runs, "slow")
    assert slow["step"] is None and slow["extra"] is None and slow["last_step"] == 30
    # FP32 reached the slow run's final 3.8 between steps 20 (4.0) and 30 (3.5)
    reached = 20 + 10 * (3.8 * (1 + verdict.REACH_TOLERANCE) - 4.0) / (3.5 - 4.0)
    assert slow["fp32_step_to_final"] == pytest.approx(reached)
    assert slow["at_least_extra"] == pytest.approx(30 / reached - 1)


def test_gap_curves_pair_evaluations_by_step():
    runs = [
        run("fp32", 0, 3.5, [(10, 5.0), (20, 4.0)]),
        run("off", 0, 4.5, [(10, 5.5), (20, 4.5), (30, 4.4)]),
    ]
    assert verdict.gap_curves(runs, "off") == {0: [(10, 0.5), (20, 0.5)]}  # step 30 has no FP32 partner


def _three_seeds(off_curve, fp32_curve):
    runs = []
    for seed in range(3):
        runs.append(run("fp32", seed, fp32_curve[-1][1], fp32_curve))
        runs.append(
            run("off", seed, off_curve[-1][1] + 0.01 * seed, [(s, v + 0.01 * seed) for s, v in off_curve])
        )
    return runs


def test_stalled_slowed_and_diverged_are_different_findings():
    fp32 = [(s, 8.0 - 0.3 * i) for i, s in enumerate(range(10, 90, 10))]  # improves to the end
    flat = [(10, 7.9), (20, 7.5), (30, 7.3), (40, 7.2), (50, 7.2), (60, 7.25), (70, 7.21), (80, 7.22)]
    assert verdict.curve_finding(_three_seeds(flat, fp32), "off")["finding"] == "stalled"
    slower = [(s, v + 0.2) for s, v in fp32]  # improves, but behind FP32 at every seed
    assert verdict.curve_finding(_three_seeds(slower, fp32), "off")["finding"] == "slowed"
    rising = [(10, 7.9), (20, 7.0), (30, 6.5), (40, 6.4), (50, 6.6), (60, 6.9), (70, 7.1), (80, 7.3)]
    assert verdict.curve_finding(_three_seeds(rising, fp32), "off")["finding"] == "diverged"
    runs = _three_seeds(fp32, fp32)
    for r in runs:  # final losses off by +0.01, -0.02, +0.005: no consistent sign
        if r["setting"] == "off":
            r["final_eval"]["eval_loss"] = fp32[-1][1] + [0.01, -0.02, 0.005][r["seed"]]
    assert verdict.curve_finding(runs, "off")["finding"] == "no measurable difference"


def test_t_quantiles():
    assert verdict.t_quantile_975(2) == pytest.approx(4.303)
    assert verdict.t_quantile_975(1000) == pytest.approx(1.962, abs=2e-3)
    with pytest.raises(ValueError):
        verdict.t_quantile_975(0)


def test_one_skipped_overflow_is_not_divergence_but_ending_on_one_is():
    fp32 = [(10, 6.0), (20, 5.5), (30, 5.2)]
    runs = []
    for seed in range(3):
        runs.append(run("fp32", seed, 5.2, fp32))
        runs.append(
            run("off", seed, 5.3, [(10, 6.1), (20, 5.6), (30, 5.3)], train_loss=[7.0, float("inf"), 5.4])
        )
    assert verdict.curve_finding(runs, "off")["finding"] == "slowed"
    runs[-1]["train_loss"] = [7.0, 6.0, float("nan")]
    assert verdict.curve_finding(runs, "off")["diverged_seeds"] == [2]
