"""DDP (gloo, 2 ranks) with a model held in FP16 and FP32 masters, against the same model with FP32
weights computing in FP16 (tests/master_twin.py), under plain `DistributedDataParallel` (with
`gradient_as_bucket_view` False and True) and through Accelerate (`accelerator.accumulate`):
generated programs of micro-batches, `no_sync()` accumulation, an inf or NaN on one rank only, clipping
over the model's parameters. After every optimizer step, on each rank: FP16 weights, masters, optimizer
state, scaler statistics, and whether the step was skipped. The twin's data keep every FP16 sum exact,
so the all-reduce of FP16 gradients and of FP32 ones agree bitwise.

Run: python -m torch.distributed.run --standalone --nproc_per_node 2 tests/scripts/ddp_twin.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import random
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from master_twin import CONFIG, KINDS, Module, batch, initial_values  # noqa: E402

from hf_lossscale import DynamicLossScaler  # noqa: E402

KIND_INDEX = {k: i for i, k in enumerate(KINDS)}


def programs(n: int) -> list[dict]:
    """The same programs on every rank (seeded); each micro-batch has a kind per rank."""
    rng = random.Random(55)
    out = []
    for k in range(n):
        steps = []
        for _ in range(rng.randint(3, 6)):
            micro = []
            for _ in range(rng.choice((1, 2))):
                kinds = ["finite", "finite"]
                if rng.random() < 0.3:  # an overflow on one rank only
                    kinds[rng.randrange(2)] = rng.choice(KINDS[1:])
                micro.append(kinds)
            steps.append({"micro": micro, "clip": rng.choice((None, 0.5, 1e3))})
        out.append({"opt": ("adamw", "sgd_momentum", "adamw_fused", "rmsprop")[k % 4], "steps": steps,
                    "bucket_view": bool(k % 2)})  # fmt: skip
    return out


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=0.05, fused=True)
    if kind == "rmsprop":
        return torch.optim.RMSprop(params, lr=0.01, momentum=0.5)
    return torch.optim.AdamW(params, lr=0.05)


def inputs(seed: int, kind: str) -> dict:
    b = batch(seed, kind)
    return {
        "x": b["x"].float(),
        "t1": b["t1"].float(),
        "t2": b["t2"].float(),
        "kind": torch.tensor([KIND_INDEX[kind]]),
    }


def snapshot(module, opt, scaler, skipped) -> dict:
    inner = getattr(opt, "optimizer", opt)
    params = [p for g in inner.param_groups for p in g["params"]]
    return {
        "weights16": [p.detach().half().clone() for p in module.parameters()],
        "fp32": [p.detach().float().clone() for p in params],
        "state": [{k: v.clone() for k, v in inner.state.get(p, {}).items()} for p in params],
        "stats": scaler.stats(),
        "skipped": skipped,
    }


def differences(a: dict, b: dict, where: str) -> list[str]:
    out = []
    for n, (x, y) in enumerate(zip(a["weights16"], b["weights16"], strict=True)):
        if not torch.equal(x, y):
            out.append(f"{where}: FP16 weight {n}")
    for n, (x, y) in enumerate(zip(a["fp32"], b["fp32"], strict=True)):
        if not torch.equal(x, y):
            out.append(f"{where}: master {n} vs the reference's FP32 weight")
    for n, (x, y) in enumerate(zip(a["state"], b["state"], strict=True)):
        if sorted(x) != sorted(y) or any(not torch.equal(x[k], y[k]) for k in x):
            out.append(f"{where}: optimizer state of tensor {n}")
    for key in ("stats", "skipped"):
        if a[key] != b[key]:
            out.append(f"{where}: {key} {a[key]} vs {b[key]}")
    return out


def plain_ddp(prog: dict, dtype: torch.dtype, rank: int) -> list[dict]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    module = Module(initial_values(), dtype)
    model = DDP(module, gradient_as_bucket_view=prog["bucket_view"])
    opt = make_optimizer(prog["opt"], model.parameters())
    scaler = DynamicLossScaler(**CONFIG)
    snaps, seed = [], 0
    for spec in prog["steps"]:
        for m, kinds in enumerate(spec["micro"]):
            seed += 1
            last = m == len(spec["micro"]) - 1
            with model.no_sync() if not last else _nothing():
                loss = model(**inputs(seed * 2 + rank, kinds[rank]))["loss"]
                scaler.scale(loss / len(spec["micro"])).backward()
        if spec["clip"] is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(module.parameters(), spec["clip"])
        scaler.step(opt)
        scaler.update()
        skipped = scaler.last_step_skipped
        opt.zero_grad()
        snaps.append(snapshot(module, opt, scaler, skipped))
    return snaps


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def through_accelerate(prog: dict, dtype: torch.dtype, rank: int) -> list[dict]:
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.state import AcceleratorState, GradientState

    from hf_lossscale import LossScaleConfig, install_loss_scaler

    AcceleratorState._reset_state()
    GradientState._reset_state()
    ga = max(len(s["micro"]) for s in prog["steps"])
    accelerator = Accelerator(
        mixed_precision="fp16", cpu=True, gradient_accumulation_steps=ga,
        kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=prog["bucket_view"])],
    )  # fmt: skip
    scaler = install_loss_scaler(accelerator, LossScaleConfig(**CONFIG))
    module = Module(initial_values(), dtype)
    opt = make_optimizer(prog["opt"], module.parameters())
    model, opt = accelerator.prepare(module, opt)
    snaps, seed = [], 0
    for spec in prog["steps"]:
        micro = list(spec["micro"]) + [spec["micro"][-1]] * (ga - len(spec["micro"]))
        for kinds in micro:
            seed += 1
            with accelerator.accumulate(model):
                accelerator.backward(model(**inputs(seed * 2 + rank, kinds[rank]))["loss"])
                if accelerator.sync_gradients and spec["clip"] is not None:
                    accelerator.clip_grad_norm_(model.parameters(), spec["clip"])
                opt.step()
                opt.zero_grad()
        snaps.append(
            snapshot(accelerator.unwrap_model(model), opt, scaler, accelerator.optimizer_step_was_skipped)
        )
    return snaps


def main() -> None:
    out_dir = sys.argv[1]
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"rank": rank, "runs": []}
    for k, prog in enumerate(programs(int(os.environ.get("HF_LOSSSCALE_DDP_PROGRAMS", "8")))):
        for path, run in (("ddp", plain_ddp), ("accelerate", through_accelerate)):
            sub, ref = run(prog, torch.float16, rank), run(prog, torch.float32, rank)
            diffs = [
                d
                for i, (a, b) in enumerate(zip(sub, ref, strict=True))
                for d in differences(a, b, f"step {i}")
            ]
            masters = sum(p.dtype == torch.float32 for p in sub[0]["fp32"]) if sub else 0
            result["runs"].append({
                "path": path, "program": k, "opt": prog["opt"], "bucket_view": prog["bucket_view"],
                "steps": len(sub), "skipped": [s["skipped"] for s in sub], "masters": masters,
                "differences": diffs[:5],
            })  # fmt: skip
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
