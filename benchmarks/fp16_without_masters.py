"""FP16 weights stepped directly (a pure FP16 optimizer, what users try when they force FP16 weights)
against FP16 weights + FP32 master weights: the share of each step's weight updates smaller than
half an FP16 ulp of their weight (lost: the FP16 weight rounds back to itself), and the loss.

A 2-layer, 128-wide GPT-2 from its config (seed 0, as the reproduced `shakespeare-scratch`), on
tiny-shakespeare (`$HF_LOSSSCALE_DATA/tinyshakespeare/input.txt`; without it, the Python docs' text),
8 x 64 tokens per step, AdamW, at a pre-training and a fine-tuning learning rate; both arms from the
same weights and batches. The masters' arm measures, at each step, the update it applied (FP32) against
half the FP16 ulp of each weight; the pure arm steps AdamW on the FP16 weights (gradients unscaled in
FP32, then stored as FP16), as `optimizer.step()` on a `.half()` model does.

    python benchmarks/fp16_without_masters.py [--steps 150] [--out benchmarks/results/fp16_without_masters.json]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch


def text() -> str:
    path = Path(os.environ.get("HF_LOSSSCALE_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    path = path / "tinyshakespeare" / "input.txt"
    if path.is_file():
        return path.read_text()
    import pydoc_data.topics

    return "\n".join(pydoc_data.topics.topics.values())


def batches(steps: int, vocab: int = 256, batch: int = 8, seq: int = 64) -> list[torch.Tensor]:
    data = torch.tensor(list(text().encode("utf-8", errors="replace")[:400_000]), dtype=torch.long) % vocab
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(data) - seq - 1, (steps, batch), generator=g)
    return [torch.stack([data[s : s + seq] for s in row]) for row in starts]


def model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=256, n_positions=64, n_layer=2, n_embd=128, n_head=2, bos_token_id=0, eos_token_id=0
        )
    ).half()


def run(arm: str, lr: float, data: list[torch.Tensor]) -> dict:
    from hf_lossscale import DynamicLossScaler

    net = model().train()
    params = list(net.parameters())
    scaler = DynamicLossScaler(init_scale=2.0**12, growth_interval=50)
    opt = torch.optim.AdamW(params, lr=lr, foreach=True, eps=1e-6)
    losses, lost = [], []
    for ids in data:
        opt.zero_grad()
        net.zero_grad()
        loss = net(input_ids=ids, labels=ids).loss.float()
        losses.append(loss.item())
        if arm == "masters":
            before = [p.detach().clone() for p in net.parameters()]
            masters_before = [m.detach().clone() for _, m in scaler.master_weights.pairs(opt)]
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            pairs = scaler.master_weights.pairs(opt)
            if masters_before and len(pairs) == len(before):
                total = small = 0
                for (_, m), m0, w0 in zip(pairs, masters_before, before, strict=True):
                    update = (m.detach() - m0).abs()
                    ulp = _ulp16(w0)
                    moved = update > 0
                    total += int(moved.sum())
                    small += int((moved & (update < ulp / 2)).sum())
                lost.append(small / max(total, 1))
        else:  # the pure FP16 optimizer: gradients unscaled in FP32, stored as FP16; AdamW on FP16 weights
            (loss * 2.0**12).backward()
            with torch.no_grad():
                grads = [p.grad.float() / 2.0**12 for p in params]
                if not all(torch.isfinite(g).all() for g in grads):
                    continue
                for p, g in zip(params, grads, strict=True):
                    p.grad = g.half()
            before = [p.detach().float() for p in params]
            opt.step()
            # what the pure optimizer lost: elements whose FP16 weight did not move
            moved = sum(int((p.detach().float() != b).sum()) for p, b in zip(params, before, strict=True))
            lost.append(1 - moved / sum(p.numel() for p in params))
    return {
        "arm": arm,
        "lr": lr,
        "loss": losses,
        "lost_share": lost,
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
    }


def _ulp16(w: torch.Tensor) -> torch.Tensor:
    """The FP16 ulp at each weight (subnormal spacing at the bottom)."""
    a = w.detach().float().abs().clamp(min=2.0**-14)
    return torch.exp2(torch.floor(torch.log2(a)) - 10)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 1e-5])
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = batches(opts.steps)
    rows = []
    for lr in opts.lrs:
        for arm in ("masters", "pure"):
            r = run(arm, lr, data)
            rows.append(r)
            lost = r["lost_share"]
            print(f"lr {lr:g} {arm:>7}: loss {r['loss'][0]:.3f} -> {r['final_loss']:.3f} (mean of the last 10); "
                  f"updates lost per step: mean {sum(lost) / max(len(lost), 1):.1%}", flush=True)  # fmt: skip
    if opts.out:
        Path(opts.out).write_text(json.dumps({"steps": opts.steps, "rows": rows}) + "\n")
    if opts.plot:
        _plot(rows, opts.plot)
    return 0


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in rows:
        style = "-" if r["arm"] == "masters" else "--"
        a.plot(
            r["loss"],
            style,
            label=f"lr {r['lr']:g}, {'FP16 + masters' if r['arm'] == 'masters' else 'pure FP16'}",
        )
        b.plot(r["lost_share"], style, label=f"lr {r['lr']:g}, {r['arm']}")
    a.set_yscale("log")
    a.set_xlabel("step"), a.set_ylabel("training loss (log)"), a.legend(fontsize=7)
    b.set_xlabel("step"), b.set_ylabel("share of weight updates lost"), b.legend(fontsize=7)
    b.set_title("masters: updates < half an FP16 ulp; pure: weights that did not move", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
