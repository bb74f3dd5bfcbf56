"""Build `loss_scaling_explained.ipynb` from the cells below (outputs stripped; CI executes it).

python notebooks/build_notebook.py
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    (
        "md",
        """# Loss scaling, explained

FP16 keeps 5 exponent bits and 10 mantissa bits. Small gradients fall off its bottom end and become
exactly zero; loss scaling lifts them back into range. This notebook computes FP16's range from its
bit layout, shows underflow in a small real model, static scaling too low and too high, dynamic
scaling recovering, and the telemetry that shows where gradients sit on the FP16 number line.
Everything runs on a CPU in seconds: FP16 is *emulated* (`hf_lossscale.fp16_emulation`: FP16
rounding, underflow and overflow at FP32 speed).""",
    ),
    (
        "code",
        """import math
import torch
import matplotlib.pyplot as plt
from hf_lossscale import DynamicLossScaler, LossScaleConfig, fp16_emulation, measure_flushed_fraction
torch.manual_seed(0)""",
    ),
    (
        "md",
        """## 1. FP16's range, from its bits

A normal FP16 number is `(-1)^s * 2^(e - 15) * (1 + m / 2^10)` with a 5-bit exponent field `e` in
1..30 (0 is for zero and subnormals, 31 for inf/NaN) and a 10-bit mantissa `m`. Subnormals
(`e = 0`) are `2^-14 * m / 2^10`.""",
    ),
    (
        "code",
        """EXP_BITS, MAN_BITS = 5, 10
bias = 2 ** (EXP_BITS - 1) - 1
largest = (2 - 2.0 ** -MAN_BITS) * 2.0 ** ((2 ** EXP_BITS - 2) - bias)
smallest_normal = 2.0 ** (1 - bias)
smallest_subnormal = smallest_normal * 2.0 ** -MAN_BITS
print(f"bias {bias}; largest {largest}; smallest normal 2^{math.log2(smallest_normal):.0f}; "
      f"smallest subnormal 2^{math.log2(smallest_subnormal):.0f} = {smallest_subnormal:.3g}")
# The same numbers from the bit patterns themselves: 0x7BFF, 0x0400, 0x0001 read as float16
bits = torch.tensor([0x7BFF, 0x0400, 0x0001], dtype=torch.int16).view(torch.float16).float().tolist()
assert bits == [largest, smallest_normal, smallest_subnormal]
print("a gradient of 1e-8 in FP16:", torch.tensor(1e-8).half().item(), "; scaled by 2^16 and back:",
      (torch.tensor(1e-8) * 2**16).half().float().item() / 2**16)""",
    ),
    (
        "md",
        """## 2. Underflow in a small real model

A small BERT-style masked language model (built from a config, no download). Training divides the
loss by the number of accumulated micro-batches, and averages over every predicted token: the
gradients shrink. `measure_flushed_fraction` runs the same batch in FP32 and in FP16 and counts the
non-zero FP32 gradient elements that come out zero.""",
    ),
    (
        "code",
        """from transformers import BertConfig, BertForMaskedLM
config = BertConfig(vocab_size=2000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=128, max_position_embeddings=64)
model = BertForMaskedLM(config)
ids = torch.randint(5, 2000, (4, 64))
batch = {"input_ids": ids, "labels": ids.clone()}
rows = []
for divisor in (1, 16, 256):
    for scale in (1.0, 2.0 ** 8, 2.0 ** 16):
        r = measure_flushed_fraction(model, batch, loss_divisor=divisor, scale=scale)
        rows.append((divisor, scale, r["flushed_fraction"], r["overflow"]))
        print(f"loss / {divisor:>3}, scale 2^{int(math.log2(scale)):>2}: flushed {r['flushed_fraction']:7.2%}"
              f"{'  OVERFLOW' if r['overflow'] else ''}")""",
    ),
    (
        "md",
        """## 3. Static scaling: too low and too high

The same model trained for 30 steps under FP16 emulation. **Too low**: with the loss divided by 256
(long accumulation), no scaling (scale 1) flushes most gradient elements to zero and training
falls behind a static scale of 2^10. **Too high**: with the loss divided by 16, a static 2^24
overflows at every step, and every step is skipped: the model never trains.""",
    ),
    (
        "code",
        """config_kwargs = dict(vocab_size=2000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=64)

def train(config, divisor, steps=30, seed=0):
    torch.manual_seed(seed)
    m = BertForMaskedLM(BertConfig(**config_kwargs))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    scaler = DynamicLossScaler(config)
    data = torch.randint(5, 40, (steps, 4, 32), generator=torch.Generator().manual_seed(1))  # learnable
    losses, scales = [], []
    for x in data:
        with fp16_emulation():
            loss = m(input_ids=x, labels=x).loss
        scaler.scale(loss / divisor).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    flushed = measure_flushed_fraction(m, {"input_ids": data[0], "labels": data[0]}, loss_divisor=divisor,
                                       scale=scaler.get_scale())
    return losses, scales, scaler.stats(), flushed

runs = {
    "/256, no scaling": train(LossScaleConfig(mode="off"), 256),
    "/256, static 2^10": train(LossScaleConfig(mode="static", init_scale=2.0 ** 10), 256),
    "/16, static 2^24": train(LossScaleConfig(mode="static", init_scale=2.0 ** 24, max_consecutive_skips=None), 16),
    "/16, static 2^10": train(LossScaleConfig(mode="static", init_scale=2.0 ** 10), 16),
}
for label, (losses, _, stats, flushed) in runs.items():
    lost = "overflow" if flushed["overflow"] else f"{flushed['flushed_fraction']:.1%} flushed"
    print(f"{label:>18}: loss {losses[0]:.2f} -> {losses[-1]:.2f}; skipped {stats['skipped_steps']}/30; {lost}")
    plt.plot(losses, label=label)
plt.xlabel("step"); plt.ylabel("training loss"); plt.legend(); plt.show()""",
    ),
    (
        "md",
        """## 4. Dynamic scaling recovers

Start far too high (2^24, loss divided by 16). Each overflow halves the scale and skips the step;
after `growth_interval` clean steps it doubles again. It settles at the highest scale that does
not overflow, at the cost of a few skipped steps at the start.""",
    ),
    (
        "code",
        """losses, scales, stats, flushed = train(LossScaleConfig(init_scale=2.0 ** 24, growth_interval=5), 16)
print(f"loss {losses[0]:.2f} -> {losses[-1]:.2f}; skipped {stats['skipped_steps']} of {stats['total_steps']}; "
      f"final scale 2^{math.log2(scales[-1]):.0f}; {flushed['flushed_fraction']:.2%} flushed")
plt.step(range(len(scales)), scales, where="post"); plt.yscale("log", base=2)
plt.xlabel("step"); plt.ylabel("loss scale"); plt.title("dynamic scaling from 2^24"); plt.show()""",
    ),
    (
        "md",
        """## 5. Where the gradients sit: telemetry

Every `telemetry_interval` steps the scaler histograms the binary exponents of the scaled gradients
on the device (no host synchronisation until the figures are read). The heat map shows each
step's distribution against FP16's limits: what falls below the 2^-24 line is lost in FP16.""",
    ),
    (
        "code",
        """from hf_lossscale.tools.report import exponent_heatmap
snapshots = []
for scale in (1.0, 2.0 ** 8, 2.0 ** 16):
    torch.manual_seed(0)
    m = BertForMaskedLM(BertConfig(**config_kwargs))
    scaler = DynamicLossScaler(mode="static", init_scale=scale, telemetry_interval=1)
    scaler.set_parameter_names(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    x = torch.randint(5, 40, (4, 32))
    with fp16_emulation():
        loss = m(input_ids=x, labels=x).loss / 64
    scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
    snap = scaler.telemetry.read()
    snap["step"] = f"2^{int(math.log2(scale))}"
    snapshots.append(snap)
    print(f"scale {snap['step']:>5}: zero {snap['zero_frac']:.1%}, subnormal {snap['subnormal_frac']:.1%}, "
          f"headroom {snap['headroom_bits']:.1f} bits")
fig, ax = plt.subplots(figsize=(7, 5))
exponent_heatmap(ax, snapshots, "scaled gradients at scales 2^0, 2^8, 2^16 (x axis)")
plt.show()""",
    ),
    (
        "md",
        """In a training run, `LossScaleTrainer` logs `grad_zero_frac`, `grad_subnormal_frac` and
`headroom_bits` at every log step, writes the histograms to `loss_scale_log.jsonl`, and
`hf-lossscale report RUN_DIR` draws this heat map over the steps. `hf-lossscale advise` measures a
real model on real text in FP32 and recommends a starting scale.""",
    ),
]


def build() -> nbformat.NotebookNode:
    cells = [new_markdown_cell(src) if kind == "md" else new_code_cell(src) for kind, src in CELLS]
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


if __name__ == "__main__":
    path = Path(__file__).with_name("loss_scaling_explained.ipynb")
    nbformat.write(build(), path)
    print(f"wrote {path}")
