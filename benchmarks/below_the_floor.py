"""FP16 weights below the FP32 masters' memory (issue 49): FP32 masters, a Kahan compensation buffer,
stochastic rounding and plain FP16 (no masters) against FP32 weights, three seeds, two learning rates.

The model and data of `fp16_without_masters.py` (a 2-layer, 128-wide GPT-2 from its config on
tiny-shakespeare, 8 x 64 tokens per step, AdamW eps 1e-6, 150 steps), each seed its own initial
weights and batches, shared by every arm; 16 held-out batches evaluate the end. Per step, the share
of updates lost: among the elements with a non-zero gradient, those whose stored weight did not move
(the value the optimizer updates: the FP32 master, the FP16 weight plus its compensation, or the FP16
weight); and the share whose FP16 weight (what the forward reads) did not move. Stochastic rounding
loses an update below half an ulp at a step only by chance: in expectation it keeps it. Paired
verdicts on the held-out loss against FP32 (`hf_lossscale.tools.verdict.paired_verdict`).

    python benchmarks/below_the_floor.py [--steps 150] [--seeds 0 1 2] [--out benchmarks/results/below_the_floor.json]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fp16_without_masters import batches, model

ARMS = ("fp32", "masters", "kahan", "stochastic_rounding", "pure")


def _data(seed: int, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    every = batches(steps + 16 + 16 * seed)  # the batches of seed s start 16 s further in the stream
    return every[16 * seed : 16 * seed + steps], every[-16:]


def _stored(arm: str, net: torch.nn.Module, opt: torch.optim.Optimizer, params: list) -> list[torch.Tensor]:
    """The value each weight element holds for the optimizer (FP32)."""
    if arm == "masters":
        found = opt._hf_lossscale_masters  # noqa: SLF001 (the optimizer's own masters)
        by_half = {id(p.half): p for p in found.pairs.values()}
        return [by_half[id(p)].master.detach().clone() for p in params]
    if arm == "kahan":
        found = opt._hf_lossscale_masters  # noqa: SLF001
        by_half = {id(p.half): p for p in found.pairs.values()}
        return [p.detach().float() + by_half[id(p)].compensation.float() for p in params]
    return [p.detach().float().clone() for p in params]


def seeded_model(seed: int) -> torch.nn.Module:
    """The tiny GPT-2 in FP16: seed 0's initial weights, moved by this seed's draw (each seed starts
    elsewhere)."""
    torch.manual_seed(seed)
    net = model()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p.float()).mul_(0.02).half())
    return net


def lm_loss(net: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return net(input_ids=ids, labels=ids).loss.float()


def run(
    arm: str,
    lr: float,
    seed: int,
    data: list,
    held_out: list,
    *,
    make_net: Callable[[int], torch.nn.Module] = seeded_model,
    loss_of: Callable[[torch.nn.Module, Any], torch.Tensor] = lm_loss,
    eps: float = 1e-6,
    weight_decay: float = 0.01,
) -> dict:
    """One arm's run from `make_net(seed)` (an FP16 model) over `data`, measuring the updates lost at
    each step; `loss_of(net, batch)` its loss. FP16 models compute their products on FP32 kernels
    (`fp16_products()`: a GPU's FP16 arithmetic at FP32 speed on a CPU)."""
    from hf_lossscale import DynamicLossScaler, LossScaleConfig
    from hf_lossscale.fp16.half_products import fp16_products

    net = make_net(seed)
    if arm == "fp32":
        net = net.float()
    net.train()
    torch.manual_seed(seed)  # the same dropout masks for every arm
    params = [p for p in net.parameters() if p.requires_grad]
    mode = {"fp32": True, "masters": True, "pure": False}.get(arm, arm)
    scaler = DynamicLossScaler(
        config=LossScaleConfig(init_scale=2.0**12, growth_interval=50, master_weights=mode)
    )
    opt = torch.optim.AdamW(params, lr=lr, foreach=True, eps=eps, weight_decay=weight_decay)
    losses, lost, fp16_still = [], [], []
    for step, batch in enumerate(data):
        with fp16_products():
            losses_at, lost_at, still_at = _step(arm, step, batch, net, params, opt, scaler, loss_of)
        losses.append(losses_at)
        if lost_at is not None:
            lost.append(lost_at)
            fp16_still.append(still_at)
    net.eval()
    with torch.no_grad(), fp16_products():
        eval_loss = statistics.fmean(loss_of(net, b).item() for b in held_out)
    return {
        "setting": arm,
        "seed": seed,
        "lr": lr,
        "loss": losses,
        "lost_share": lost,
        "fp16_unmoved_share": fp16_still,
        "final_eval": {"eval_loss": eval_loss},
        "skipped_steps": scaler.stats()["skipped_steps"] if arm != "pure" else None,
    }


def _step(arm, step, batch, net, params, opt, scaler, loss_of) -> tuple[float, float | None, float | None]:
    """One optimizer step; (its loss, the share of updates lost, the share of FP16 weights unmoved)."""
    opt.zero_grad()
    loss = loss_of(net, batch)
    measure = step > 0 and arm != "fp32"  # (the first step makes the masters)
    before = _stored(arm, net, opt, params) if measure else None
    weights = [p.detach().clone() for p in params] if measure else None
    if arm == "pure":  # the pure FP16 optimizer: gradients unscaled in FP32, stored as FP16
        (loss * 2.0**12).backward()
        with torch.no_grad():
            grads = [p.grad.float() / 2.0**12 for p in params]
            if not all(torch.isfinite(g).all() for g in grads):
                return loss.item(), None, None
            for p, g in zip(params, grads, strict=True):
                p.grad = g.half()
        nonzero = [g != 0 for g in grads]
        opt.step()
    else:
        scaler.scale(loss).backward()
        nonzero = [scaler.master_weights.grad(opt, p) != 0 for p in params] if measure else None
        scaler.step(opt)
        scaler.update()
    if not measure:
        return loss.item(), None, None
    after = _stored(arm, net, opt, params)
    total = sum(int(n.sum()) for n in nonzero)
    kept = sum(int((n & (a == b)).sum()) for n, a, b in zip(nonzero, after, before, strict=True))
    still = sum(int((n & (p.detach() == w)).sum()) for n, p, w in zip(nonzero, params, weights, strict=True))
    return loss.item(), kept / max(total, 1), still / max(total, 1)


def verdicts(rows: list[dict]) -> list[dict]:
    from hf_lossscale.tools.verdict import paired_verdict

    out = []
    for lr in sorted({r["lr"] for r in rows}, reverse=True):
        runs = [r for r in rows if r["lr"] == lr]
        for arm in ARMS[1:]:
            found = paired_verdict(runs, arm, "eval_loss")
            found["lr"] = lr
            out.append(found)
    return out


def table(rows: list[dict], found: list[dict]) -> str:
    lines = [
        "| lr | weights | held-out loss per seed | paired gap to FP32 (mean, 95% interval) | verdict | "
        "updates lost per step (mean) | FP16 weight unmoved per step (mean) |",
        "|---|---|---|---|---|---|---|",
    ]
    for lr in sorted({r["lr"] for r in rows}, reverse=True):
        for arm in ARMS:
            runs = sorted((r for r in rows if r["lr"] == lr and r["setting"] == arm), key=lambda r: r["seed"])
            if not runs:
                continue
            losses = " / ".join(f"{r['final_eval']['eval_loss']:.4f}" for r in runs)
            v = next((f for f in found if f["lr"] == lr and f["setting"] == arm), None)
            gap = verdict = "—"
            if v is not None and v.get("n"):
                interval = v.get("interval")
                gap = f"{v['mean']:+.4f}" + (f" [{interval[0]:+.4f}, {interval[1]:+.4f}]" if interval else "")
                verdict = v["verdict"]
            lost = [x for r in runs for x in r["lost_share"]]
            still = [x for r in runs for x in r["fp16_unmoved_share"]]
            if arm == "fp32":
                lines.append(f"| {lr:g} | {arm} | {losses} | — | (the reference) | — | — |")
                continue
            share = lambda xs: f"{statistics.fmean(xs):.1%}" if xs else "—"  # noqa: E731
            lines.append(
                f"| {lr:g} | {arm} | {losses} | {gap} | {verdict} | {share(lost)} | {share(still)} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 1e-5])
    parser.add_argument("--out", default=None, help="JSON results; a Markdown table is written beside it.")
    opts = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    torch.set_num_threads(1)
    rows = []
    for seed in opts.seeds:
        data, held_out = _data(seed, opts.steps)
        for lr in opts.lrs:
            for arm in ARMS:
                r = run(arm, lr, seed, data, held_out)
                rows.append(r)
                lost = statistics.fmean(r["lost_share"]) if r["lost_share"] else 0.0
                print(f"seed {seed} lr {lr:g} {arm:>19}: held-out loss {r['final_eval']['eval_loss']:.4f}, "
                      f"updates lost per step {lost:.1%}", flush=True)  # fmt: skip
    found = verdicts(rows)
    text = table(rows, found)
    print(text)
    if opts.out:
        out = Path(opts.out)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"steps": opts.steps, "rows": rows, "verdicts": found}) + "\n")
        tmp.replace(out)
        out.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
