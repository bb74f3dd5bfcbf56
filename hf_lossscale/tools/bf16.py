"""Whether this machine computes BF16 (and FP16) natively: the demo and `compare` ask before running
BF16; `native_fp16()` says whether native CPU FP16 (`fp16_on_cpu="native"`) runs on FP16 hardware.

A CPU without AVX512-BF16 or AMX runs BF16 autocast through conversions: a MiniLM-L6 forward and
backward of 4 x 128 tokens took 25 s against FP32's 0.73 s on a 2-core AMD EPYC with AVX2 (34x), and
19.0 s against 0.73 s (26x) on an AVX512-BF16 AMD EPYC with torch's AVX2 kernels and oneDNN held to
AVX2 (`python benchmarks/bf16_cpu_speed.py`), where native BF16 took 0.59x FP32's time. On CUDA the
question is `torch.cuda.is_bf16_supported(including_emulation=False)`: a T4 or V100 says True
without it and runs BF16 in emulation.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

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
    return _native_on_cpu(hardware, _ONEDNN_BF16_MARKERS, "BF16")


def _native_on_cpu(hardware: dict[str, bool], onednn_markers: tuple[str, ...], kind: str) -> tuple[bool, str]:
    """Native `kind` on this CPU: some of `hardware` present, and neither torch's kernels nor oneDNN's
    ISA ceiling held below it; with the line that says why."""
    has = [k for k, v in hardware.items() if v]
    capability = torch.backends.cpu.get_cpu_capability()
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    held = []  # what keeps the hardware unused
    if capability in ("DEFAULT", "NO AVX", "AVX2"):
        held.append(f"torch runs {capability} kernels")
    if isa and not any(m in isa for m in onednn_markers):
        held.append(f"ONEDNN_MAX_CPU_ISA={isa}")
    native = bool(has) and not held
    if not has:
        why = f"CPU ({capability}) without {' or '.join(hardware)}"
    elif held:
        why = f"CPU with {' and '.join(has)}, but {' and '.join(held)}"
    else:
        why = f"CPU with {' and '.join(has)} ({capability} kernels)"
    return native, f"{why}: {'native' if native else 'no native'} {kind}"


# oneDNN's ISA ceilings that include FP16 instructions (AVX512_CORE_FP16 and up: in oneDNN's order
# AVX512_CORE_AMX includes AVX512_CORE_FP16; AVX512_CORE_BF16 does not).
_ONEDNN_FP16_MARKERS = ("FP16", "AMX", "AVX10", "ALL")


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The first processor's flags in `/proc/cpuinfo` (empty where there is none: not Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cpu_name(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The processor's model name ("AMD EPYC", "Intel(R) Xeon(R) Platinum 8480+"), with its core
    count: what every CPU speed figure is reported with."""
    name = ""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "unknown CPU"
    return f"{name}, {os.cpu_count()} cores"


def native_fp16(device: str | None = None, *, flags: set[str] | None = None) -> tuple[bool, str]:
    """(whether `device` -- "cuda", "cpu" or None for the one runs would use -- computes FP16
    natively, a line naming what was asked). On a CPU: AVX512-FP16 or AMX-FP16 in `/proc/cpuinfo`'s
    flags (or `flags`), with torch's kernels and oneDNN not held below them. Where it is native,
    `fp16_on_cpu="native"` can be faster than the emulation (the default, which computes what a GPU
    computes); elsewhere native CPU FP16 runs through conversions, many times slower than FP32."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return True, f"{torch.cuda.get_device_name()}: native FP16"
    flags = cpu_flags() if flags is None else flags
    if not flags:  # no /proc/cpuinfo: torch's own check (it knows AMX-FP16, not AVX512-FP16)
        flags = {"amx_fp16"} if torch.cpu._is_amx_fp16_supported() else set()
    hardware = {"AVX512-FP16": "avx512_fp16" in flags, "AMX-FP16": "amx_fp16" in flags}
    return _native_on_cpu(hardware, _ONEDNN_FP16_MARKERS, "FP16")


def slow_bf16_warning(line: str) -> str:
    return (
        f"BF16 here: {line}. BF16 autocast then runs through conversions, about {CPU_EMULATED_SLOWDOWN}x "
        "slower than FP32 (measured, `benchmarks/bf16_cpu_speed.py`): each BF16 run may take hours."
    )
