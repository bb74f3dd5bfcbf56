"""GPU + DeepSpeed only: `accelerate launch --num_processes 1 deepspeed_check.py OUT`. LossScaleTrainer under
DeepSpeed leaves the engine's scaler in place, warns where its fp16 section differs from the
loss-scale config, and logs the engine's loss_scale and skipped_steps."""

import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_models import tiny_bert_classifier, tiny_classification_dataset  # noqa: E402

from hf_lossscale import LossScaleConfig, LossScaleTrainer, LossScaleTrainingArguments  # noqa: E402
from hf_lossscale.integrations.deepspeed import to_deepspeed_config  # noqa: E402


class Injecting(LossScaleTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        return loss * float("inf") if self.state.global_step == 3 else loss


def main():
    out = Path(sys.argv[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp16 = to_deepspeed_config(LossScaleConfig(init_scale=2.0**10, growth_interval=1000))
    ds = {"fp16": fp16, "zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}  # fmt: skip
    args = LossScaleTrainingArguments(
        str(out / "run"), fp16=True, deepspeed=ds, max_steps=6, logging_steps=1, per_device_train_batch_size=8,
        report_to=[], save_strategy="no", disable_tqdm=True, loss_scale_init=2.0**10,
        loss_scale_growth_interval=1000, loss_scale_hysteresis=2,  # hysteresis differs: must warn
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Injecting(
            model=tiny_bert_classifier(), args=args, train_dataset=tiny_classification_dataset()
        )
        trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    result = {
        "loss_scaler": trainer.loss_scaler is not None,
        "warned_hysteresis": any("hysteresis=1 (config: 2)" in str(w.message) for w in caught),
        "scales": [e.get("loss_scale") for e in logs],
        "skipped": [e.get("skipped_steps") for e in logs],
    }
    (out / "deepspeed.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
