"""`python -m torch.distributed.run --standalone --nproc_per_node 2 grpo_fsdp2_check.py OUT MODE`: GRPO in
FP16 under FSDP2 on two gloo ranks (the CPU), through the Trainer (`fsdp=True, fsdp_config={"version": 2}`).

Accelerate applies its FSDP plugin only on accelerator devices: on the CPU it drops it and wraps the
model in DDP. MODE `accelerate-on-cpu` runs that as it is (`FP16GRPOTrainer` refuses it; each rank writes
the error). MODE `fsdp2` lifts that one gate (the plugin kept, `distributed_type` FSDP, as Accelerate
sets it on GPUs), so the model goes through Accelerate's own FSDP2 preparation (`fully_shard`, DTensor
parameters and gradients) on gloo, and:

an inf is written into rank 1's local shard of one gradient only, after the gradients are reduced and
before the scaler reads them (step `BAD`); each rank records per optimizer step whether it skipped,
the scale, the applied-step count, TRL's micro-step counter, the LR scheduler and a fingerprint of its
full parameters, and writes them with its logs and events to OUT/rank<r>.json."""

import json
import os
import sys
from pathlib import Path

BAD = 2
STEPS = 4


def main() -> None:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    out, mode = Path(sys.argv[1]), sys.argv[2]
    from datasets import Dataset
    from transformers import TrainerCallback

    from hf_lossscale.integrations.grpo import FP16GRPOTrainer, KVCacheSampler
    from hf_lossscale.integrations.trl_trainers import FP16GRPOConfig
    from hf_lossscale.recipes.grpo import GRPOTaskArguments, build_model, corpus_text, prompts_from

    rank = int(os.environ["RANK"])
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    own_init = AcceleratorState.__init__

    def init(self, *a, fsdp_plugin=None, **k):
        own_init(self, *a, fsdp_plugin=fsdp_plugin, **k)
        plugin = fsdp_plugin or getattr(self, "fsdp_plugin", None)
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            if fsdp_plugin is not None and self._mixed_precision != "no":
                plugin.set_mixed_precision(self._mixed_precision)
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, plugin

    if mode == "fsdp2":
        AcceleratorState.__init__ = init
    task = GRPOTaskArguments(model_name_or_path=None, scratch_layers=1, scratch_width=32)
    model, tokenizer = build_model(task, str(out / "model"), seed=0)  # the same weights on both ranks
    text = corpus_text(None)[:20000]
    args = FP16GRPOConfig(
        output_dir=str(out / "run"), fp16=True, use_cpu=True, max_steps=STEPS, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=6, logging_steps=1, report_to=[], save_strategy="no",
        disable_tqdm=True, learning_rate=1e-2, lr_scheduler_type="linear", loss_scale_init=1024.0, beta=0.0,
        fsdp=True, fsdp_config={"version": 2, "reshard_after_forward": True}, max_grad_norm=0.0, seed=0,
    )  # fmt: skip

    class Watch(TrainerCallback):
        def __init__(self):
            self.rows = []
            self.trainer = None

        def on_step_begin(self, args, state, control, **kwargs):
            self.armed = state.global_step + 1 == BAD and rank == 1

        def on_step_end(self, args, state, control, model=None, lr_scheduler=None, **kwargs):
            t = self.trainer
            full = [
                (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double()
                for p in model.parameters()
            ]

            self.rows.append({
                "step": state.global_step,
                "skipped": bool(t.accelerator.optimizer_step_was_skipped),
                "scale": t.loss_scaler.get_scale(),
                "applied_steps": t.applied_steps,
                "trl_step": t._step,
                "scheduler_steps": lr_scheduler.last_epoch,
                "params": [round(float(x.sum()), 6) for x in full],
            })  # fmt: skip

    watch = Watch()
    try:
        trainer = FP16GRPOTrainer(
            model=model, args=args, processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": prompts_from(text, tokenizer, 8, 64)}),
            reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
            rollout_func=KVCacheSampler("auto"), callbacks=[watch],
        )  # fmt: skip
    except ValueError as error:
        (out / f"rank{rank}.json").write_text(json.dumps({"refused": str(error)}))
        return
    watch.trainer = trainer
    watch.armed = False
    clip = trainer.accelerator.clip_grad_norm_

    def clip_after_inf(parameters, *a, **k):  # the gradients are reduced: an inf in rank 1's shard only
        parameters = list(parameters)
        if watch.armed:
            watch.armed = False
            grad = next(p.grad for p in parameters if p.grad is not None)
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
        return clip(parameters, *a, **k)

    trainer.accelerator.clip_grad_norm_ = clip_after_inf
    trainer.train()
    events_file = Path(args.output_dir) / "loss_scale_log.jsonl"
    events = (
        [json.loads(line) for line in events_file.read_text().splitlines()] if events_file.exists() else []
    )
    stats = trainer.loss_scaler.stats()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    result = {
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "fsdp_version": getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", None),
        "param_types": sorted({type(p).__name__ for p in trainer.model.parameters()}),
        "rows": watch.rows,
        "stats": {k: stats[k] for k in ("total_steps", "skipped_steps", "loss_scale")},
        "applied_steps": trainer.applied_steps,
        "logged_applied_steps": [h.get("applied_steps") for h in logged],
        "logged_mismatch": [h.get("mismatch/mean_abs_dlogp") for h in logged],
        "mismatch_events": [e for e in events if e["event"] == "mismatch"],
        "skip_events": [e for e in events if e["event"] == "grpo_skip"],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
