"""The one-pass master-weight AdamW step on CUDA (issue 49, item 2) against today's chunked update and
against torch's fused AdamW on FP32 weights, in the same process: time per optimizer step and the
memory traffic it implies, in GB/s against the device's memory bandwidth.

Each arm steps the same tensors (one parameter of `--numel` elements, or a GPT-2-shaped list of them
with `--shapes gpt2`) with FP16 gradients pending in the scaler's hand-over:

- `one-pass`: `master_kernel.run_one_pass`, one launch for the whole group (reads the FP16 gradient,
  the FP32 master and moments once, writes master, moments and the FP16 weight): 28 bytes per
  parameter;
- `chunked`: `master_step.run_chunked` with torch's fused kernel on FP32 chunks cast from the FP16
  gradient (the CPU's path, and CUDA's without Triton): 28 + 4 + 4 + 2 bytes per parameter (the cast
  writes and re-reads an FP32 chunk, the FP16 weight is written from the master);
- `fp32 fused`: torch's fused AdamW on FP32 weights with FP32 gradients: 4 + 16 + 16 = 32 bytes;
- `te FusedAdam`: Transformer Engine's `FusedAdam(master_weights=True)` on the FP16 weights (its
  FP32 masters in its state), 28 bytes, where `transformer_engine.pytorch` imports. It cannot be
  carried to the lent machine: its torch binding (`transformer_engine_torch`) has no wheel on PyPI
  (a source build against the machine's torch and CUDA), and the core wheel is 729 MB against the
  device tool's 64 MiB; the arm runs where the machine has it installed.

The GB/s column counts each arm's own bytes; `peak` is the device's memory bandwidth from its
properties (bus width x memory clock x 2). Noise: each figure is the median of `--repeats` timed
blocks of `--steps` steps; the spread (min-max over blocks) is printed next to it.

    python benchmarks/master_kernel.py [--numel 67108864] [--shapes gpt2|gpt2-no-decay] [--chunks 16384 ...]
        [--warps 4 ...] [--json out.json]

`--chunks` adds one-pass arms with other program sizes: a program never spans two tensors, so the size
matters for a group of few large tensors (one of 2M elements gets 32 programs at the default 64Ki, for
an H100's 132 SMs: `--numel 2097152 --chunks 8192 16384`); `programs_at` in the JSON gives each size's
program count. `--warps 4` adds an arm with programs of 4 warps instead of `NUM_WARPS` (8).
`--shapes gpt2-no-decay` is the Trainer's other group for GPT-2, stepped with weight_decay=0: 98
tensors of at most 3,072 elements, one program each, where a launch's fixed cost is the most of its
time.

Needs CUDA and Triton (torch's CUDA wheels ship it); elsewhere it says so and exits 0 without a file.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import sys

import torch

GPT2_SHAPES = [(50257, 768), (1024, 768)] + [(768, 2304), (2304,), (768, 768), (768,), (768,), (768,),
                                             (768, 3072), (3072,), (3072, 768), (768,), (768,), (768,)] * 12 + [
    (768,), (768,)]  # the final LayerNorm  # fmt: skip
#: The Trainer's no-decay group of GPT-2 (biases and LayerNorm weights, 1-D): a group of small tensors.
GPT2_NO_DECAY_SHAPES = [s for s in GPT2_SHAPES if len(s) == 1]


def _peak_gbs() -> float | None:
    props = torch.cuda.get_device_properties(0)
    width, clock = getattr(props, "memory_bus_width", None), getattr(props, "memory_clock_rate", None)
    if not width or not clock:
        return None
    return width / 8 * clock * 1e3 * 2 / 1e9  # bytes per transfer x transfers per second (DDR)


def _time(fn, steps: int, repeats: int) -> tuple[float, float, float]:
    fn()  # warm-up (compiles the kernel)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times), min(times), max(times)


def _transformer_engine_arm(masters: list[torch.Tensor], grads16: list[torch.Tensor], weight_decay: float):
    """Transformer Engine's FusedAdam with FP32 master weights on FP16 copies of the weights, or None
    where it does not import."""
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam
    except Exception:  # not installed, or built for another torch or CUDA
        return None
    halves = [torch.nn.Parameter(m.half()) for m in masters]
    for p, g in zip(halves, grads16, strict=True):
        p.grad = g
    opt = FusedAdam(halves, lr=1e-4, weight_decay=weight_decay, master_weights=True)
    return opt.step


def run(
    shapes: list[tuple[int, ...]],
    steps: int,
    repeats: int,
    chunks: tuple[int, ...] = (),
    warps: tuple[int, ...] = (),
    weight_decay: float = 0.01,
) -> dict:
    from hf_lossscale.masters import kernel as master_kernel
    from hf_lossscale.masters.kernel import OnePassSlot, run_one_pass
    from hf_lossscale.masters.step import Slot, adam_state, run_chunked

    dev = "cuda"
    masters = [torch.randn(s, device=dev) * 0.02 for s in shapes]
    halves = [m.half() for m in masters]
    grads16 = [torch.randn(s, device=dev).half() for s in shapes]
    factor = torch.tensor(2.0**-16, device=dev)
    scale, found_inf = torch.tensor(1.0, device=dev), torch.zeros((), device=dev)
    keys = [torch.nn.Parameter(m) for m in masters]
    opt = torch.optim.AdamW(keys, lr=1e-4, weight_decay=weight_decay, fused=True)
    group = opt.param_groups[0]
    slots = [OnePassSlot(k, g, factor, k.data, h) for k, g, h in zip(keys, grads16, halves, strict=True)]

    def one_pass():
        assert run_one_pass(opt, group, slots, lambda key: adam_state(opt, group, key), scale, found_inf)

    def one_pass_at(name, value):  # the kernel with the module's CHUNK or NUM_WARPS set (given back after)
        def step():
            default = getattr(master_kernel, name)
            setattr(master_kernel, name, value)
            try:
                one_pass()
            finally:
                setattr(master_kernel, name, default)

        return step

    def chunk_slot(k, g, h):
        flat_m, flat_g, flat_h = k.data.view(-1), g.view(-1), h.view(-1)
        return Slot(key=k, numel=k.numel(), flat=True, grad_of=lambda a, b: flat_g[a:b].float().mul_(factor),
                    load=lambda a, b: flat_m[a:b], store=lambda a, b, v: flat_h[a:b].copy_(v))  # fmt: skip

    chunk_slots = [chunk_slot(k, g, h) for k, g, h in zip(keys, grads16, halves, strict=True)]

    def chunked():
        run_chunked(opt, group, chunk_slots, scale, found_inf)

    fp32 = [torch.nn.Parameter(m.clone()) for m in masters]
    for p, g in zip(fp32, grads16, strict=True):
        p.grad = g.float()
    fp32_opt = torch.optim.AdamW(fp32, lr=1e-4, weight_decay=weight_decay, fused=True)
    fp32_opt.grad_scale, fp32_opt.found_inf = scale, found_inf
    n = sum(m.numel() for m in masters)
    arms = {"one-pass": (one_pass, 28), "chunked": (chunked, 38), "fp32 fused": (fp32_opt.step, 32)}
    for chunk in chunks:
        arms[f"one-pass chunk={chunk}"] = (one_pass_at("CHUNK", chunk), 28)
    for w in warps:
        arms[f"one-pass warps={w}"] = (one_pass_at("NUM_WARPS", w), 28)
    te_step = _transformer_engine_arm(masters, grads16, weight_decay)
    if te_step is not None:
        arms["te FusedAdam"] = (te_step, 28)
    out = {"parameters": n, "tensors": len(shapes), "device": torch.cuda.get_device_name(0), "peak_gbs": _peak_gbs(),
           "steps": steps, "repeats": repeats, "arms": {}}  # fmt: skip
    for name, (fn, bytes_per) in arms.items():
        median, low, high = _time(fn, steps, repeats)
        out["arms"][name] = {"ms": median, "ms_min": low, "ms_max": high, "bytes_per_param": bytes_per,
                             "gbs": n * bytes_per / (median / 1e3) / 1e9}  # fmt: skip
    base = out["arms"]["fp32 fused"]["ms"]
    for arm in out["arms"].values():
        arm["time_vs_fp32_fused"] = arm["ms"] / base
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--numel", type=int, default=1 << 26, help="One parameter of this many elements.")
    parser.add_argument(
        "--shapes",
        choices=["one", "gpt2", "gpt2-no-decay"],
        default="one",
        help="gpt2: GPT-2 124M's tensors; gpt2-no-decay: its 1-D ones (the Trainer's no-decay group).",
    )
    parser.add_argument(
        "--chunks",
        type=int,
        nargs="*",
        default=(),
        help="More one-pass arms, each with programs of this many elements (multiples of the kernel's "
        "BLOCK; the default arm uses masters.kernel.CHUNK).",
    )
    parser.add_argument(
        "--warps",
        type=int,
        nargs="*",
        default=(),
        help="More one-pass arms, each with programs of this many warps (the default arm: NUM_WARPS).",
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="Write the figures here.")
    opts = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from hf_lossscale.masters import kernel as master_kernel
    from hf_lossscale.masters.kernel import triton_available

    bad = [c for c in opts.chunks if c <= 0 or c % master_kernel.BLOCK]
    if bad:
        parser.error(f"--chunks {bad}: each must be a positive multiple of {master_kernel.BLOCK}")
    bad = [w for w in opts.warps if w not in (1, 2, 4, 8, 16, 32)]
    if bad:
        parser.error(f"--warps {bad}: each must be a power of two from 1 to 32")

    if not torch.cuda.is_available() or not triton_available():
        print("master_kernel.py: needs CUDA and Triton (this machine has "
              f"{'no CUDA' if not torch.cuda.is_available() else 'no Triton'}); nothing measured.")  # fmt: skip
        return 0
    shapes = {"one": [(opts.numel,)], "gpt2": GPT2_SHAPES, "gpt2-no-decay": GPT2_NO_DECAY_SHAPES}[opts.shapes]
    # the no-decay group is the Trainer's weight_decay=0 group: the kernel's path without decay
    decay = 0.0 if opts.shapes == "gpt2-no-decay" else 0.01
    result = run(shapes, opts.steps, opts.repeats, tuple(opts.chunks), tuple(opts.warps), decay)
    result["weight_decay"] = decay
    result["programs_at"] = {
        chunk: sum(-(-math.prod(s) // chunk) for s in shapes) for chunk in (master_kernel.CHUNK, *opts.chunks)
    }
    peak = result["peak_gbs"]
    print(f"{result['device']}: {result['parameters']:,} parameters in {result['tensors']} tensors; "
          f"memory bandwidth {peak:.0f} GB/s" if peak else "")  # fmt: skip
    print("| arm | ms per step (min-max) | x fp32 fused | bytes/param | GB/s | of peak |")
    print("|---|---|---|---|---|---|")
    for name, arm in result["arms"].items():
        share = f"{arm['gbs'] / peak:.0%}" if peak else "-"
        print(f"| {name} | {arm['ms']:.3f} ({arm['ms_min']:.3f}-{arm['ms_max']:.3f}) | "
              f"{arm['time_vs_fp32_fused']:.2f} | {arm['bytes_per_param']} | {arm['gbs']:.0f} | {share} |")  # fmt: skip
    if opts.json:
        from hf_lossscale.tools.files import atomic_write_text

        atomic_write_text(opts.json, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
