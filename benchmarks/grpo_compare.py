"""GRPO in FP16 + dynamic scaling against BF16 and FP32, three seeds, on this CPU: reward, the
sampler/trainer mismatch tails and skipped steps per run, with paired verdicts.

    python benchmarks/grpo_compare.py                      # runs (two one-thread streams), then the table
    python benchmarks/grpo_compare.py --summarize_only     # the table from runs already made
    python benchmarks/grpo_compare.py --jobs 9 --results_name grpo_h200 -- --tokenizer_name_or_path DIR  # a GPU

It runs `hf-lossscale compare recipes/grpo.py --settings fp32,dynamic,bf16` (so `--reuse_finished`
resumes, and Ctrl-C stops every run within seconds, leaving no half-written result), then reads each
run's event log: the per-step `mismatch` events of `FP16GRPOTrainer` and its train logs (`reward`).
The sampler is `KVCacheSampler` (generation with a KV cache) in the trainer's precision; the policy
a 2-layer 128-wide GPT-2 from scratch (seeded: the same initial weights in every setting); prompts
are 16-token windows of the Python documentation and the reward is the share of a completion's words
found in that text (`hf_lossscale/recipes/grpo.py`). FP16 is emulated on the CPU
(`fp16_emulation(policy="cuda")`), BF16 is native autocast: these are not GPU measurements.

Writes `results/grpo/grpo_cpu.json` (per run: every figure below, and the command) and
`results/grpo/grpo_cpu.md` (the table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "grpo"
RECIPE_ARGS = [
    "--per_device_train_batch_size", "16", "--num_generations", "8", "--max_completion_length", "16",
    "--learning_rate", "2e-3", "--beta", "0.0", "--report_to", "none", "--save_strategy", "no",
    "--disable_tqdm", "true", "--max_eval_prompts", "16",
]  # fmt: skip
SETTINGS = ("fp32", "dynamic", "bf16")
ADDITION_STEPS = 1000
LABEL = {"fp32": "FP32", "dynamic": "FP16 + dynamic scaling", "bf16": "BF16"}
#: per run: (key, what it is, lower is better)
FIGURES = [
    ("reward_first", "mean reward, first 25 steps", False),
    ("reward_last", "mean reward, last 25 steps", False),
    ("steps_to_0.9", "first step whose reward >= 0.9", True),
    ("eval_reward", "reward on held-out prompts, at the end", False),
    ("mismatch_mean", "mean |Δ log p| (mean over steps)", True),
    ("mismatch_p95", "p95 |Δ log p| (mean over steps)", True),
    ("mismatch_max", "max |Δ log p| (over the run)", True),
    ("outside_band", "tokens with ratio outside [0.9, 1.1] (mean over steps)", True),
    ("k3_kl", "k3 KL(sampler || trainer) (mean over steps)", True),
    ("chi2_token", "chi2 per token, mean(r^2) - 1 (mean over steps)", True),
    ("chi2_seq", "chi2 per sequence, mean(R^2) - 1 (mean over steps)", True),
    ("log_ppl_abs_diff", "|log PPL_trainer - log PPL_sampler| per sequence (mean over steps)", True),
    (
        "pearson_probs",
        "Pearson correlation of the sampler's and trainer's token probabilities (mean over steps)",
        False,
    ),
    ("k3_drift", "k3 KL's least-squares slope per 100 steps over the run", True),
    (
        "reward_rise_last",
        "reward's least-squares slope per 100 steps over the last quarter of the run",
        False,
    ),
]
#: --task addition: n-digit sums from a 2-layer 64-wide GPT-2 over a 16-token digit vocabulary
#: (`recipes/grpo.py --task addition`), TRL's adaptive entropy bonus holding the entropy near 1 nat so
#: that exploration outlives the first digits (a fixed 0.02 bonus let seed 0 collapse and stall at 0.43)
ADDITION_ARGS = [
    "--task", "addition", "--addition_digits", "3", "--scratch_width", "64", "--max_completion_length", "4",
    "--per_device_train_batch_size", "128", "--num_generations", "8", "--learning_rate", "3e-4",
    "--lr_scheduler_type", "constant", "--entropy_coef", "0.02", "--use_adaptive_entropy", "true",
    "--entropy_target", "1.0", "--beta", "0.0", "--report_to", "none",
    "--save_strategy", "no", "--disable_tqdm", "true", "--max_eval_prompts", "256",
]  # fmt: skip


def run_figures(folder: Path) -> dict:
    """The figures of one run, from its event log."""
    events = [
        json.loads(line)
        for line in (folder / "loss_scale_log.jsonl").read_text().splitlines()
        if line.strip()
    ]
    logs = [e for e in events if e["event"] == "log" and "reward" in e and "loss" in e]
    rows = [e for e in events if e["event"] == "mismatch"]
    end = next((e for e in reversed(events) if e["event"] == "run_end"), {})
    evals = [e for e in events if e["event"] == "log" and "eval_reward" in e]
    rewards = [e["reward"] for e in logs]
    reached = next((e["step"] for e in logs if e["reward"] >= 0.9), None)

    def mean(key):
        values = [r[key] for r in rows if r.get(key) is not None and r[key] == r[key]]
        return statistics.fmean(values) if values else None

    from hf_lossscale.integrations.grpo import MismatchDrift

    drift, rise = MismatchDrift(), MismatchDrift()
    for r in rows:
        if r.get("k3_kl") is not None:
            drift.update(r["step"], r["k3_kl"])
    last = logs[len(logs) - len(logs) // 4 :]
    for e in last:
        rise.update(e["step"], e["reward"])
    drift_summary, rise_summary = drift.summary(), rise.summary()

    return {
        "steps": len(logs),
        "reward_first": statistics.fmean(rewards[:25]) if rewards else None,
        "reward_last": statistics.fmean(rewards[-25:]) if rewards else None,
        "steps_to_0.9": reached,
        "eval_reward": evals[-1]["eval_reward"] if evals else None,
        "mismatch_mean": mean("mean_abs_dlogp"),
        "mismatch_p95": mean("p95_abs_dlogp"),
        "mismatch_max": max((r["max_abs_dlogp"] for r in rows), default=None),
        "outside_band": mean("outside_band_frac"),
        "k3_kl": mean("k3_kl"),
        "chi2_token": mean("chi2_token"),
        "chi2_seq": mean("chi2_seq"),
        "log_ppl_abs_diff": mean("log_ppl_abs_diff"),
        "pearson_probs": mean("pearson_probs"),
        "k3_drift": drift_summary["slope_per_100_steps"] if drift_summary else None,
        "k3_drift_growing": drift_summary["growing"] if drift_summary else None,
        "reward_rise_last": rise_summary["slope_per_100_steps"] if rise_summary else None,
        "skipped_steps": end.get("skipped_steps"),
        "total_steps": end.get("total_steps"),
        "mismatch_steps": len(rows),
    }


def paired(runs: list[dict], setting: str, key: str, lower_better: bool, baseline: str = "fp32") -> dict:
    """Paired gaps setting - baseline per seed, their mean and 95% t-interval, and a word."""
    from hf_lossscale.tools.verdict import paired_verdict

    records = [{"setting": r["setting"], "seed": r["seed"], "final_eval": {key: r[key]}} for r in runs
               if r[key] is not None]  # fmt: skip
    v = paired_verdict(records, setting, key, baseline=baseline, higher_better=not lower_better)
    interval, word = v.get("interval"), v["verdict"]
    if word in ("worse", "better"):  # which way it went, then what that means
        word = f"{'higher' if interval[0] > 0 else 'lower'} ({word})"
    return {"gaps": v.get("gaps", []), "mean": v.get("mean"), "interval": interval, "word": word}


def _fmt(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, int):
        return str(x)
    return f"{x:.3g}" if abs(x) < 0.01 and x != 0 else f"{x:.4f}"


def render(result: dict) -> str:
    runs = result["runs"]
    lines = [f"Command: `{result['command']}`", "", f"Machine: {result['machine']}.", ""]
    head = ["setting", "seed", *[k for k, _, _ in FIGURES], "k3 growing", "skipped steps"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(runs, key=lambda r: (SETTINGS.index(r["setting"]), r["seed"])):
        cells = [LABEL[r["setting"]], str(r["seed"]), *[_fmt(r[k]) for k, _, _ in FIGURES],
                 {True: "yes", False: "no"}.get(r.get("k3_drift_growing"), "—"),
                 "—" if r["setting"] != "dynamic" else f"{r['skipped_steps'] or 0}/{r['total_steps']}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Figures: " + "; ".join(f"`{k}` = {what}" for k, what, _ in FIGURES)
              + "; `k3 growing` = MismatchDrift's verdict over the run (a slope at 3 standard errors whose fitted "
              "line at least doubles).", ""]  # fmt: skip
    lines += ["Paired verdicts (gap per seed in seed order, mean, 95% t-interval over 3 seeds):", ""]
    lines += ["| figure | comparison | gaps | mean | 95% interval | verdict |", "|---|---|---|---|---|---|"]
    for key, _, _ in FIGURES:
        for setting, base in (("dynamic", "fp32"), ("bf16", "fp32"), ("bf16", "dynamic")):
            v = result["verdicts"][key][f"{setting}-{base}"]
            interval = (
                "—" if v["interval"] is None else f"[{_fmt(v['interval'][0])}, {_fmt(v['interval'][1])}]"
            )
            lines.append(f"| `{key}` | {LABEL[setting]} − {LABEL[base]} | " + ", ".join(_fmt(g) for g in v["gaps"])
                         + f" | {_fmt(v['mean'])} | {interval} | {v['word']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def summarize(folder: Path, command: str, name: str = "grpo_cpu") -> dict:
    from hf_lossscale.tools.files import atomic_write_text

    sys.path.insert(0, str(ROOT / "benchmarks" / "reproduce"))
    from run import machine  # beside the reproduced benchmarks

    runs = []
    for setting in SETTINGS:
        for run in sorted((folder / "runs").glob(f"{setting}-seed*")):
            record = json.loads((run / "run.json").read_text()) if (run / "run.json").is_file() else {}
            if record.get("returncode") != 0 or not (run / "loss_scale_log.jsonl").is_file():
                continue
            runs.append({"setting": setting, "seed": int(run.name.rsplit("seed", 1)[1]), **run_figures(run)})
    verdicts = {key: {f"{s}-{b}": paired(runs, s, key, lower, baseline=b)
                      for s, b in (("dynamic", "fp32"), ("bf16", "fp32"), ("bf16", "dynamic"))}
                for key, _, lower in FIGURES}  # fmt: skip
    result = {"command": command, "machine": machine(), "runs": runs, "verdicts": verdicts}
    OUT.mkdir(parents=True, exist_ok=True)
    atomic_write_text(OUT / f"{name}.json", json.dumps(result, indent=1) + "\n")
    atomic_write_text(OUT / f"{name}.md", render(result))
    return result


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output_dir", default=None, help="Default: runs/grpo-compare (runs/grpo-addition).")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                        help="Run these settings only (the table reads every finished run in --output_dir).")  # fmt: skip
    parser.add_argument(
        "--max_steps", type=int, default=None, help="Default: 250, or ADDITION_STEPS with --task addition."
    )
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--summarize_only", action="store_true")
    parser.add_argument("--results_name", default=None, help="Write results/grpo/<NAME>.json and .md "
                        "(default: grpo_cpu, or grpo_addition_cpu with --task addition).")  # fmt: skip
    parser.add_argument("--task", choices=["vocabulary", "addition"], default="vocabulary",
                        help="vocabulary (saturates by step ~130) or addition (exact per-digit reward; does not).")  # fmt: skip
    opts = parser.parse_args(own)
    if opts.output_dir is None:
        opts.output_dir = str(
            ROOT / "runs" / ("grpo-addition" if opts.task == "addition" else "grpo-compare")
        )
    if opts.results_name is None:
        opts.results_name = "grpo_addition_cpu" if opts.task == "addition" else "grpo_cpu"
    if opts.max_steps is None:
        opts.max_steps = ADDITION_STEPS if opts.task == "addition" else 250
    recipe_args = ADDITION_ARGS if opts.task == "addition" else RECIPE_ARGS
    command = ["compare", str(ROOT / "recipes" / "grpo.py"), "--settings", ",".join(opts.settings),
               "--seeds", *map(str, opts.seeds), "--max_steps", str(opts.max_steps), "--jobs", str(opts.jobs),
               "--no_flushed_probe", "--reuse_finished", "--output_dir", opts.output_dir, "--", *recipe_args, *extra]  # fmt: skip
    kept = [a for a in own if a != "--summarize_only"]  # the command that made the runs
    shown = " ".join(["python benchmarks/grpo_compare.py", *kept, *(["--", *extra] if extra else [])])
    if not opts.summarize_only:
        import os

        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from hf_lossscale.tools.cli import main as cli_main

        status = cli_main(command)
        if status != 0:
            print(f"The comparison exited with status {status}; summarizing the runs that finished.")
    result = summarize(Path(opts.output_dir), shown.strip(), opts.results_name)
    print(render(result))
    print(f"Wrote {OUT / (opts.results_name + '.json')} and {OUT / (opts.results_name + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
