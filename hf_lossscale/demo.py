"""A short, offline demo of loss scaling: `python -m hf_lossscale.demo`.

1. FP16's floor: a gradient of 1e-8 becomes 0 in FP16, and survives when the loss is scaled.
2. A tiny model trained under FP16 autocast on this machine's CPU, with the loss divided as in
   long gradient accumulation: how many gradient elements flush to zero with and without scaling.
3. The dynamic scaler backing off on an injected overflow and growing back.
"""

from __future__ import annotations

import torch

from . import DynamicLossScaler


def flushed_fraction(model: torch.nn.Module, x: torch.Tensor, divisor: float, scale: float) -> float:
    """Fraction of the non-zero FP32 gradient elements that come out zero under CPU FP16 autocast."""
    grads = []
    for fp16 in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = model(x).float().pow(2).mean() / divisor
        (loss * (scale if fp16 else 1.0)).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    ref, low = grads
    nonzero = ref != 0
    return ((low == 0) & nonzero).sum().item() / max(nonzero.sum().item(), 1)


def main() -> None:
    tiny = torch.tensor(1e-8)
    print("1) FP16 smallest subnormal 2^-24 =", 2.0**-24)
    print(
        f"   1e-8 in FP16: {tiny.half().item():g};  (1e-8 * 2^16) in FP16 / 2^16: "
        f"{(tiny * 2**16).half().float().item() / 2**16:g}"
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    x = torch.randn(8, 256) * 0.05
    print("2) gradient elements flushed to zero under CPU FP16 autocast (4-layer MLP)")
    print("   loss divisor | scale 1 | scale 2^16")
    for divisor in (1, 64, 4096):
        a = flushed_fraction(model, x, divisor, 1.0)
        b = flushed_fraction(model, x, divisor, 2.0**16)
        print(f"   {divisor:>12} | {a:7.2%} | {b:8.2%}")

    print("3) dynamic scaler: init 2^10, growth every 3 clean steps, inf injected at steps 2 and 3")
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(8):
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        if step in (2, 3):
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        s = scaler.stats()
        print(
            f"   step {step}: scale {s['loss_scale']:>6g}  skipped={s['last_step_skipped']!s:5}  "
            f"total skipped {s['skipped_steps']}"
        )


if __name__ == "__main__":
    main()
