"""BF16 only where the device computes it natively: the capability question, the demo's choice, and
a forced BF16 run on a processor held to AVX2 (issue 41)."""

import pytest
import torch
from tiny_models import run_tiny_compare

from hf_lossscale.tools.bf16 import native_bf16
from hf_lossscale.tools.demo import choose_bf16


def _cpu(monkeypatch, *, avx512_bf16, amx, capability="AVX512"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)


@pytest.mark.parametrize(
    "avx512_bf16, amx, capability, isa, native",
    [
        (False, False, "AVX2", None, False),  # the EPYC: AVX2, no BF16 instructions
        (True, False, "AVX512", None, True),
        (False, True, "AVX512", None, True),
        (True, False, "AVX2", None, False),  # BF16 hardware, torch held to AVX2 kernels
        (True, False, "AVX512", "AVX2", False),  # oneDNN held below BF16
        (True, False, "AVX512", "AVX512_CORE_BF16", True),
    ],
)
def test_the_cpu_answer_follows_the_capability(monkeypatch, avx512_bf16, amx, capability, isa, native):
    """Bug caught: "every CPU has BF16" (the old rule), which ran the demo's BF16 34x slower."""
    _cpu(monkeypatch, avx512_bf16=avx512_bf16, amx=amx, capability=capability)
    if isa:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    got, line = native_bf16()
    assert got is native
    assert line.endswith("native BF16") and (("no native" in line) is not native)


def test_cuda_asks_without_emulation(monkeypatch):
    """Bug caught: `is_bf16_supported()` with its default, which says True on a T4 (emulated BF16)."""
    asked = {}

    def is_bf16_supported(including_emulation=True):
        asked["including_emulation"] = including_emulation
        return including_emulation  # a T4: only emulated

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    assert native_bf16("cuda") == (False, "Tesla T4: no native BF16")
    assert asked == {"including_emulation": False}


def test_the_demo_leaves_bf16_out_only_where_it_is_slow(monkeypatch, capsys):
    import hf_lossscale.tools.demo as demo

    slow = (False, "CPU (AVX2) without AVX512-BF16 or AMX: no native BF16")
    monkeypatch.setattr(demo, "native_bf16", lambda device=None: slow)
    assert choose_bf16(None) is False
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "BF16 left out" in out and "--bf16" in out and "AVX2" in out
    assert choose_bf16(True) is True and "slower than FP32" in capsys.readouterr().out  # forced: runs, warned
    assert choose_bf16(False) is False
    monkeypatch.setattr(demo, "native_bf16", lambda device=None: (True, "CPU with AMX: native BF16"))
    assert choose_bf16(None) is True and capsys.readouterr().out == ""


def test_a_forced_bf16_comparison_runs_on_a_processor_held_to_avx2(tmp_path, monkeypatch, capsys):
    """`compare --settings fp32,bf16` with torch's kernels and oneDNN held to AVX2 (what a CPU without
    BF16 instructions runs): it warns with the measured slowdown before the runs, and the BF16 run
    still finishes, as BF16. Bug caught: the warning refusing instead of warning, or missing."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # the runs' processes start with it
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    code, out = run_tiny_compare(tmp_path, "fp32,bf16")
    captured = capsys.readouterr()
    assert code == 0, captured.out[-3000:] + captured.err[-3000:]
    # why it is slow: the ceiling where the processor has BF16 instructions, their absence where it has none
    hardware = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    why = "ONEDNN_MAX_CPU_ISA=AVX2" if hardware else "without AVX512-BF16 or AMX"
    assert why in captured.err and "slower than FP32" in captured.err
    assert "[   bf16 seed 0]" in captured.out or "bf16 seed 0" in captured.out
    row = next(line for line in (out / "summary.md").read_text().splitlines() if line.startswith("| BF16"))
    assert row.rstrip(" |").endswith("ok"), row  # the BF16 run finished, as BF16


# ---------------------------------------------------------------- native FP16 (issue 48)
@pytest.mark.parametrize(
    "flags, capability, isa, native",
    [
        ({"avx2", "avx512f", "avx512_bf16"}, "AVX512", None, False),  # this AMD EPYC: BF16, no FP16
        ({"avx2"}, "AVX2", None, False),
        ({"avx512f", "avx512_fp16", "amx_tile", "amx_bf16"}, "AVX512", None, True),  # Sapphire Rapids
        ({"avx512f", "avx512_fp16", "amx_fp16"}, "AVX512", None, True),  # Granite Rapids
        ({"avx512f", "avx512_fp16"}, "AVX2", None, False),  # torch held to AVX2 kernels
        ({"avx512f", "avx512_fp16"}, "AVX512", "AVX512_CORE_BF16", False),  # oneDNN held below FP16
        ({"avx512f", "avx512_fp16"}, "AVX512", "AVX512_CORE_FP16", True),
        ({"avx512f", "avx512_fp16", "amx_fp16"}, "AVX512", "AVX512_CORE_AMX", True),
    ],
)
def test_native_fp16_follows_the_cpu_flags(monkeypatch, flags, capability, isa, native):
    """The Xeon of issue 48 (AVX512-FP16 and AMX) computes FP16 natively; an EPYC with AVX512-BF16
    does not (BF16 instructions are not FP16 ones)."""
    from hf_lossscale.tools.bf16 import native_fp16

    _cpu(monkeypatch, avx512_bf16="avx512_bf16" in flags, amx="amx_tile" in flags, capability=capability)
    if isa:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    got, line = native_fp16(flags=flags)
    assert got is native
    assert line.endswith("native FP16") and (("no native" in line) is not native)
    if "avx512_fp16" in flags:
        assert "AVX512-FP16" in line


def test_cpu_flags_and_name_read_proc_cpuinfo(tmp_path):
    from hf_lossscale.tools.bf16 import cpu_flags, cpu_name, native_fp16

    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu avx2 avx512f avx512_fp16 "
        "amx_tile amx_bf16\n\nprocessor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
    )
    assert {"avx512_fp16", "amx_bf16"} <= cpu_flags(info) and "amx_fp16" not in cpu_flags(info)
    assert cpu_name(info).startswith("Intel(R) Xeon(R) Platinum 8480+, ")
    assert cpu_flags(tmp_path / "absent") == set()
    # this machine: whatever it is, the answer is a line that names it as native or not
    native, line = native_fp16("cpu")
    assert isinstance(native, bool) and line.endswith("native FP16")
