"""Train a tiny BERT with LossScaleTrainer (emulated FP16, injected overflows, a checkpoint every
2 steps) and optionally SIGKILL itself at a chosen point; or resume from the last checkpoint.

    python crash_train.py OUTPUT_DIR [--kill POINT:STEP] [--resume]

POINT: `step` (after optimizer step STEP), `save-model` (checkpoint-STEP: model written, nothing
else), `save-scaler` (optimizer, scheduler and scaler written, not the RNG or trainer state),
`save-state` (trainer_state.json half written).
"""

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_models import tiny_bert_classifier, tiny_classification_dataset  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainerState  # noqa: E402

from hf_lossscale import LossScaleTrainer, LossScaleTrainingArguments  # noqa: E402

BAD_STEPS = (3, 4, 7)


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class Injecting(LossScaleTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        return loss * float("inf") if self.state.global_step in BAD_STEPS else loss


class KillAfterStep(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            die()


def arm(point: str, step: int, trainer: Trainer) -> None:
    if point == "step":
        trainer.add_callback(KillAfterStep(step))
        return
    target = {"save-model": "_save_optimizer_and_scheduler", "save-scaler": "_save_rng_state"}.get(point)
    if target is not None:
        original = getattr(trainer, target)

        def killing(*args, **kwargs):
            if trainer.state.global_step == step:
                die()
            return original(*args, **kwargs)

        setattr(trainer, target, killing)
        return
    if point == "save-state":
        original = TrainerState.save_to_json

        def half_written(self, json_path):
            if self.global_step == step:
                text = self.to_json_string() if hasattr(self, "to_json_string") else "{}"
                with open(json_path, "w") as f:
                    f.write(text[: len(text) // 2])
                die()
            return original(self, json_path)

        TrainerState.save_to_json = half_written
        return
    raise SystemExit(f"unknown kill point {point!r}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--kill", default=None)
    parser.add_argument("--resume", action="store_true")
    opts = parser.parse_args()
    args = LossScaleTrainingArguments(
        opts.output_dir,
        fp16=True,
        max_steps=12,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        seed=0,
        report_to=[],
        disable_tqdm=True,
        loss_scale_init=2.0**10,
        loss_scale_growth_interval=2,
    )
    trainer = Injecting(model=tiny_bert_classifier(), args=args, train_dataset=tiny_classification_dataset())
    if opts.kill:
        point, step = opts.kill.split(":")
        arm(point, int(step), trainer)
    trainer.train(resume_from_checkpoint=True if opts.resume else None)
    trainer.save_model(os.path.join(opts.output_dir, "final"))


if __name__ == "__main__":
    main()
