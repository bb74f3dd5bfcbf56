"""The comparison's plots: `eval_loss.png`, `gap.png`, `loss_scale.png`."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from . import verdict
from .runs import FP16_SETTINGS, SETTINGS, RunResult

_LINESTYLES = ("-", "--", ":", "-.")


def write_plots(results: list[RunResult], opts: argparse.Namespace, out: Path) -> list[str]:
    from .._extras import need

    matplotlib = need("matplotlib", "hf-lossscale compare's plots", "tools")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import plot_scale

    colors = {
        "fp32": "black",
        "dynamic": "tab:blue",
        "static": "tab:red",
        "off": "tab:orange",
        "bf16": "tab:green",
        "master": "tab:purple",
        "kahan": "tab:pink",
        "stochastic": "tab:olive",
        "pure": "tab:brown",
    }

    def style(seed: int) -> str:  # one line style per seed, in the order given
        return _LINESTYLES[opts.seeds.index(seed) % len(_LINESTYLES)] if seed in opts.seeds else "-"

    def save(fig, ax, name: str, ylabel: str, title: str) -> str:
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        return name

    def mark_skips(ax, xs, ys, skipped_at, color) -> bool:
        """An x on the curve at each skipped step: from there the run is one update behind."""
        shown = [step for step in skipped_at or [] if xs and xs[0] <= step <= xs[-1]]
        if shown:
            import numpy as np

            ax.plot(shown, np.interp(shown, xs, ys), "x", color=color, markersize=11, markeredgewidth=2.5)
        return bool(shown)

    skip_note = " (x: a skipped step; the run is one update behind from there)"
    written = []
    fig, ax = plt.subplots(figsize=(7, 4.2))
    any_skip = False
    for r in sorted(results, key=lambda r: r.setting != "fp32"):  # FP32 first, wide, underneath
        if r.evals:
            xs, ys = [e["step"] for e in r.evals], [e["eval_loss"] for e in r.evals]
            ax.plot(xs, ys, marker="o",
                    color=colors[r.setting], linestyle=style(r.seed), linewidth=4 if r.setting == "fp32" else 1.5,
                    alpha=0.45 if r.setting == "fp32" else 1.0, label=f"{SETTINGS[r.setting]} (seed {r.seed})")  # fmt: skip
            if r.setting != "static":  # the static storm skips every step
                any_skip |= mark_skips(ax, xs, ys, r.skipped_at, colors[r.setting])
    written.append(
        save(fig, ax, "eval_loss.png", "eval loss", "Eval loss per setting" + (skip_note if any_skip else ""))
    )

    fig, ax = plt.subplots(figsize=(7, 4.2))
    records = [asdict(r) for r in results]
    skips = {(r.setting, r.seed): r.skipped_at for r in results}
    any_skip = False
    for setting in ("dynamic", "off", "bf16"):  # the static storm's gap (several nats) would flatten these
        for seed, points in verdict.gap_curves(records, setting).items():
            if points:
                xs, ys = [p[0] for p in points], [p[1] for p in points]
                ax.plot(xs, ys, marker="o", color=colors[setting],
                        linestyle=style(seed), label=f"{SETTINGS[setting]} (seed {seed})")  # fmt: skip
                any_skip |= mark_skips(ax, xs, ys, skips.get((setting, seed)), colors[setting])
    ax.axhline(0.0, color="black", linewidth=1)
    title = "Paired gap to FP32: grows, holds or closes"
    written.append(save(fig, ax, "gap.png", "eval loss - FP32 eval loss (same seed)",
                        title + ("\n" + skip_note.strip(" ()") if any_skip else "")))  # fmt: skip

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        if r.setting not in FP16_SETTINGS:
            continue
        plot_scale(ax, r.steps, r.loss_scale, r.skipped_at, color=colors[r.setting],
                   label=f"{SETTINGS[r.setting]} (seed {r.seed})")  # fmt: skip
    written.append(save(fig, ax, "loss_scale.png", "loss scale (x = skipped step)", "Loss scale per step"))
    return written
