"""A small Accelerate training script that knows nothing of the loss-scale settings it will get.

Run under `accelerate launch`; the loss-scale config comes from HF_LOSSSCALE_* variables.
Writes what it observed to the JSON file named on the command line.
"""

import json
import sys

import torch
from accelerate import Accelerator

from hf_lossscale import install_loss_scaler


def main(out_path: str) -> None:
    accelerator = Accelerator()
    scaler = install_loss_scaler(accelerator)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    dtypes = set()
    model[0].register_forward_hook(lambda m, i, o: dtypes.add(str(o.dtype)))
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(20):
        x = torch.randn(32, 4, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        if step == 5:
            loss = loss * float("nan")
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    result = {
        "mixed_precision": str(accelerator.mixed_precision),
        "config": scaler.config.to_dict(),
        "stats": scaler.stats(),
        "dtypes": sorted(dtypes),
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
