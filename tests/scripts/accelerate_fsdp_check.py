"""GPU only: `accelerate launch --config_file recipes/configs/fsdp_fp16.yaml --num_processes 2
accelerate_fsdp_check.py OUT VERSION`. Accelerate's FSDP (fsdp_version VERSION) with install_loss_scaler:
an inf in rank 1's gradient only, then save_state / load_state (Accelerate issue 4289)."""

import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin

from hf_lossscale import install_loss_scaler


def main():
    out, version = sys.argv[1], int(sys.argv[2])
    accelerator = Accelerator(
        mixed_precision="fp16", fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=version)
    )
    scaler = install_loss_scaler(accelerator, overrides={"init_scale": 1024.0, "growth_interval": 1000})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    rank = accelerator.process_index
    skipped = []
    for step in range(4):
        x = torch.randn(8, 64, device=accelerator.device)
        loss = model(x).float().pow(2).mean()
        accelerator.backward(loss * (float("inf") if step == 2 and rank == 1 else 1.0))
        opt.step()
        opt.zero_grad()
        skipped.append(accelerator.optimizer_step_was_skipped)
    before = scaler.stats()
    accelerator.save_state(os.path.join(out, "state"))
    scaler.update(new_scale=7.0)  # disturb, then restore
    accelerator.load_state(os.path.join(out, "state"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"skipped": skipped, "before": before, "after": scaler.stats(),
                   "sync": scaler._found_inf_group is not None}, f)  # fmt: skip


if __name__ == "__main__":
    main()
