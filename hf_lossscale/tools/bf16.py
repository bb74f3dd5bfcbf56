"""Whether this machine computes BF16 natively: the demo and `compare` ask before running BF16.

A CPU without AVX512-BF16 or AMX runs BF16 autocast through conversions: a MiniLM-L6 forward and
backward of 4 x 128 tokens took 25 s against FP32's 0.73 s on a 2-core AMD EPYC with AVX2 (34x), and
19.0 s against 0.73 s (26x) on an AVX512-BF16 AMD EPYC with torch's AVX2 kernels and oneDNN held to
AVX2 (`python benchmarks/bf16_cpu_speed.py`), where native BF16 took 0.59x FP32's time. On CUDA the
question is `torch.cuda.is_bf16_supported(including_emulation=False)`: a T4 or V100 says True
without it and runs BF16 in emulation.
"""

from __future__ import annotations

import os

import torch

#: BF16 autocast / FP32 step time measured without native BF16 (see the module docstring).
CPU_EMULATED_SLOWDOWN = 26

# oneDNN's ISA ceilings (ONEDNN_MAX_CPU_ISA) that include BF16 instructions.
_ONEDNN_BF16_MARKERS = ("BF16", "AMX", "AVX10", "ALL")


def native_bf16(device: str | None = None) -> tuple[bool, str]:
    """(whether `device` -- "cuda", "cpu" or None for the one runs would use -- computes BF16 natively,
    a line naming what was asked)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        name = torch.cuda.get_device_name()
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return native, f"{name}: {'native' if native else 'no native'} BF16"
    hardware = {
        "AVX512-BF16": torch.cpu._is_avx512_bf16_supported(),
        "AMX": torch.cpu._is_amx_tile_supported(),
    }
    has = [k for k, v in hardware.items() if v]
    capability = torch.backends.cpu.get_cpu_capability()
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    held = []  # what keeps BF16 hardware unused
    if capability in ("DEFAULT", "NO AVX", "AVX2"):
        held.append(f"torch runs {capability} kernels")
    if isa and not any(m in isa for m in _ONEDNN_BF16_MARKERS):
        held.append(f"ONEDNN_MAX_CPU_ISA={isa}")
    native = bool(has) and not held
    if not has:
        why = f"CPU ({capability}) without AVX512-BF16 or AMX"
    elif held:
        why = f"CPU with {' and '.join(has)}, but {' and '.join(held)}"
    else:
        why = f"CPU with {' and '.join(has)} ({capability} kernels)"
    return native, f"{why}: {'native' if native else 'no native'} BF16"


def slow_bf16_warning(line: str) -> str:
    return (
        f"BF16 here: {line}. BF16 autocast then runs through conversions, about {CPU_EMULATED_SLOWDOWN}x "
        "slower than FP32 (measured, `benchmarks/bf16_cpu_speed.py`): each BF16 run may take hours."
    )
