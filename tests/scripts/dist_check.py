"""Multi-process checks, one launch: `python -m torch.distributed.run --nproc_per_node 2 dist_check.py OUT`.

Each rank writes OUT/rank<R>.json with what it saw, for tests/test_distributed.py to compare:
- fsdp2: raw `fully_shard` (gloo, CPU) with DynamicLossScaler; an inf in rank 1's local shard only at
  step 3; one parameter has a single row, so rank 1 holds an empty shard of it;
- local: plain local tensors per rank (a home-made shard), with and without
  `sync_found_inf_across()`, the inf on rank 1 only;
- ddp: Accelerate (MULTI_CPU, DDP) with install_loss_scaler, an inf loss on rank 1 only;
- ddp_masters: the same with the model held in FP16 (FP32 masters), an inf gradient on rank 1 only:
  the all-reduce carries the FP16 gradients (the inf reaches every rank), the masters step alike;
- dcp: the scaler state saved and loaded with torch.distributed.checkpoint beside the FSDP2 model;
- fsdp2_clip: `DynamicLossScaler.clip_grad_norm_` against `unscale_` + torch's `clip_grad_norm_`
  on DTensor gradients (the global norm), an inf in rank 1's shard at step 2.
"""

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

from hf_lossscale import DynamicLossScaler, install_loss_scaler


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def fsdp2(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )  # (1,16): rank 1 empty
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2, telemetry_interval=1)
    scaler.set_parameter_names(model)
    local_shapes = {n: list(p.to_local().shape) for n, p in model.named_parameters()}
    history = []
    for step in range(6):
        torch.manual_seed(100 + step * 2 + rank)  # different data per rank
        x = torch.randn(4, 8)
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        if step == 3 and rank == 1:
            model[0].weight.grad.to_local()[0, 0] = float("inf")
        before = digest(full(p) for p in model.parameters())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        after = digest(full(p) for p in model.parameters())
        stats = scaler.stats()
        history.append({"skipped": stats["last_step_skipped"], "scale": stats["loss_scale"],
                        "growth": stats["growth_tracker"], "unchanged": before == after, "params": after})  # fmt: skip
    out = {"history": history, "local_shapes": local_shapes, "overflow_params": scaler.overflow_params}

    # dcp: save the scaler beside the model, load into a fresh scaler
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    path = os.path.join(sys.argv[1], "dcp")
    dcp.save({"model": get_model_state_dict(model), "scaler": scaler.state_dict()}, checkpoint_id=path)
    fresh = DynamicLossScaler(init_scale=2.0**10, growth_interval=2)
    template = {"model": get_model_state_dict(model), "scaler": fresh.state_dict()}
    dcp.load(template, checkpoint_id=path)
    fresh.load_state_dict(template["scaler"])
    out["dcp_saved"] = scaler.stats()
    out["dcp_loaded"] = fresh.stats()
    return out


def fsdp2_clip(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    out = {}
    for ours in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = DynamicLossScaler(init_scale=2.0**10)
        norms = []
        for step in range(4):
            torch.manual_seed(100 + step * 2 + rank)
            scaler.scale(model(torch.randn(4, 8)).pow(2).mean() * 10).backward()
            if step == 2 and rank == 1:
                model[0].weight.grad.to_local()[0, 0] = float("inf")
            if ours:
                norm = scaler.clip_grad_norm_(opt, 0.05, parameters=model.parameters())
            else:
                scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            norms.append(full(norm).item())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        out["ours" if ours else "torch"] = {
            "norms": norms,
            "skipped": scaler.stats()["skipped_steps"],
            "params": [full(p).detach().flatten().tolist() for p in model.parameters()],
        }
    return out


def local(rank: int, sync: bool) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    if sync:
        scaler.sync_found_inf_across()
    history = []
    for step in range(3):
        loss = model(torch.ones(2, 4)).sum()
        scaler.scale(loss).backward()
        if step == 1 and rank == 1:
            model.weight.grad[0, 0] = float("nan")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        s = scaler.stats()
        history.append({"skipped": s["last_step_skipped"], "scale": s["loss_scale"]})
    return {"history": history, "params": digest(model.parameters())}


def ddp(rank: int) -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    scaler = install_loss_scaler(accelerator, overrides={"init_scale": 2.0**10})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    history = []
    for step in range(4):
        torch.manual_seed(10 + step * 2 + rank)
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
        if step == 2 and rank == 1:
            loss = loss * float("inf")
        accelerator.backward(loss)
        before = digest(accelerator.unwrap_model(model).parameters())
        opt.step()
        opt.zero_grad()
        s = scaler.stats()
        history.append({"skipped": accelerator.optimizer_step_was_skipped, "scale": s["loss_scale"],
                        "unchanged": before == digest(accelerator.unwrap_model(model).parameters())})  # fmt: skip
    return {
        "distributed_type": str(accelerator.distributed_type),
        "num_processes": accelerator.num_processes,
        "history": history,
        "params": digest(accelerator.unwrap_model(model).parameters()),
    }


def ddp_masters(rank: int) -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    scaler = install_loss_scaler(accelerator, overrides={"init_scale": 2.0**10})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    inner = accelerator.unwrap_model(model)
    history = []
    for step in range(4):
        torch.manual_seed(10 + step * 2 + rank)
        loss = model(torch.randn(4, 8).half()).float().pow(2).mean()
        handle = None
        if step == 2 and rank == 1:  # a gradient overflow on one rank: the all-reduce spreads it
            handle = inner[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        accelerator.backward(loss)
        reduced_dtype = str(inner[0].weight.grad.dtype) if inner[0].weight.grad is not None else None
        before = digest(inner.parameters())
        opt.step()
        opt.zero_grad()
        if handle is not None:
            handle.remove()
        s = scaler.stats()
        history.append({"skipped": accelerator.optimizer_step_was_skipped, "scale": s["loss_scale"],
                        "unchanged": before == digest(inner.parameters()), "grad_dtype": reduced_dtype})  # fmt: skip
    pairs = scaler.master_weights.pairs(opt)
    return {
        "history": history,
        "params": digest(inner.parameters()),
        "masters": digest(m for _, m in pairs),
        "n_masters": len(pairs),
        "param_dtypes": sorted({str(p.dtype) for p in inner.parameters()}),
        "master_dtypes": sorted({str(m.dtype) for _, m in pairs}),
        "weights_are_rounded_masters": all(torch.equal(h, m.half()) for h, m in pairs),
    }


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "world_size": world}
    result["fsdp2"] = fsdp2(rank)
    result["fsdp2_clip"] = fsdp2_clip(rank)
    result["local_sync"] = local(rank, sync=True)
    result["local_nosync"] = local(rank, sync=False)
    result["ddp"] = ddp(rank)
    result["ddp_masters"] = ddp_masters(rank)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
