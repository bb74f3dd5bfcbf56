"""One forward and one backward overflow through `LossScaleTrainer`, as the event log records them.

A tiny BERT classifier built from a config (no download), two steps each, FP16 (emulated on a CPU):

- **forward**: layer 1's query projection rescaled as in `forward_overflow.py` (its FP32 function
  unchanged, its activations above 65504): the loss is non-finite, the scale is left alone, the
  event names the query as the origin;
- **backward**: the plain model under a static scale of 2^40: the loss is finite, the gradients
  overflow at the classifier head, the event names the module where they start.

    python benchmarks/overflow_kinds.py
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _events(model, out_dir: Path, **args) -> list[dict]:
    from tiny_models import tiny_classification_dataset

    from hf_lossscale import LossScaleTrainer, LossScaleTrainingArguments
    from hf_lossscale.core.events import read_events

    targs = LossScaleTrainingArguments(
        str(out_dir), fp16=True, max_steps=2, per_device_train_batch_size=8, report_to=[], save_strategy="no",
        disable_tqdm=True, logging_steps=1, **args,
    )  # fmt: skip
    trainer = LossScaleTrainer(model=model, args=targs, train_dataset=tiny_classification_dataset())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return [e for e in read_events(out_dir / "loss_scale_log.jsonl") if e["event"] == "overflow"]


def main() -> dict:
    from tiny_models import tiny_bert_classifier

    spec = importlib.util.spec_from_file_location(
        "forward_overflow", ROOT / "benchmarks" / "forward_overflow.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch.manual_seed(0)
    hot = tiny_bert_classifier(0)
    bench.rescale_attention(hot, 1, 20)
    with tempfile.TemporaryDirectory() as tmp:
        forward = _events(hot, Path(tmp) / "forward")
        backward = _events(tiny_bert_classifier(0), Path(tmp) / "backward", loss_scale_mode="static",
                           loss_scale_init=2.0**40, loss_scale_max=2.0**40)  # fmt: skip
    keys = (
        "event",
        "step",
        "kind",
        "origin",
        "module_type",
        "loss_nonfinite",
        "loss_scale_after",
        "modules",
        "n_params",
    )
    result = {
        "forward": {k: forward[0].get(k) for k in keys},
        "backward": {k: backward[0].get(k) for k in keys},
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
