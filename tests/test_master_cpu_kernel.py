"""The masters' one-pass Adam/AdamW step on a CPU (`masters/cpu_adam.c`, issue 56): bitwise torch's fused
optimizer on FP32 weights, through the scaler as a user steps, and where it cannot be used, the
chunked update instead (with the reason said)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from hf_lossscale import DynamicLossScaler, LossScaleConfig
from hf_lossscale.masters import cpu_kernel

#: Lengths around the vector width (8) and the kernel's work item (65536): scalar tails, items that end
#: mid-tensor, a tensor of one element.
SHAPES = [(1,), (7,), (8,), (17,), (33, 5), (65536 + 13,), (3, 40000)]

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1, fused=True),
    "adam_amsgrad_maximize": lambda ps: torch.optim.Adam(
        ps, lr=1e-3, amsgrad=True, maximize=True, fused=True
    ),
    "adamw_beta1_03": lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.3, 0.99), fused=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "sgd_nesterov_wd_foreach": lambda ps: torch.optim.SGD(
        ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=True
    ),
    "sgd_dampening_maximize": lambda ps: torch.optim.SGD(
        ps, lr=1e-2, momentum=0.5, dampening=0.1, maximize=True
    ),
    "sgd_plain_wd": lambda ps: torch.optim.SGD(ps, lr=1e-2, weight_decay=0.01),
    "sgd_maximize": lambda ps: torch.optim.SGD(ps, lr=1e-2, maximize=True),
}
#: The kernel's calls in five steps, the third overflowing: a fused Adam's skip is the kernel's (on the
#: device), SGD's the scaler's (no step); SGD's first step, which makes the momentum buffers, is the
#: chunked update's.
CALLS = {
    "sgd_momentum": 3, "sgd_nesterov_wd_foreach": 3, "sgd_dampening_maximize": 3, "sgd_plain_wd": 4,
    "sgd_maximize": 4,
}  # fmt: skip


def _prerequisites() -> bool:
    try:
        cc = (
            subprocess.run(
                [os.environ.get("CC", "cc"), "--version"], capture_output=True, timeout=30
            ).returncode
            == 0
        )
    except OSError:
        cc = False
    return (
        sys.platform.startswith("linux")
        and platform.machine() == "x86_64"
        and cc
        and {"avx2", "fma", "f16c"} <= cpu_kernel._cpu_flags()
        and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
        and os.environ.get(cpu_kernel.ENV, "1") != "0"
    )


needs_kernel = pytest.mark.skipif(
    not _prerequisites(), reason="no C compiler, x86-64 AVX2/FMA/F16C or torch AVX2+"
)


@pytest.fixture
def fresh_kernel():
    cpu_kernel._library.cache_clear()
    yield
    cpu_kernel._library.cache_clear()


@needs_kernel
def test_the_kernel_is_used_wherever_its_prerequisites_hold():
    """Bug caught: a kernel that never builds, or whose probe always finds a difference, would leave
    every other test here passing on the chunked update."""
    assert cpu_kernel.reason() is None


def _sides(kind: str, seed: int = 0):
    """FP32 weights and FP16 weights on masters with the same values and optimizer."""
    gen = torch.Generator().manual_seed(seed)
    values = [(torch.randn(s, generator=gen) * 0.1).half().float() for s in SHAPES]
    for v in values:  # zeros of each sign (a maximised zero gradient is -0: it decides the sign of a zero)
        v.view(-1)[::10] = -0.0
    sides = []
    for dtype, masters in ((torch.float32, False), (torch.float16, True)):
        params = [torch.nn.Parameter(v.to(dtype)) for v in values]
        scaler = DynamicLossScaler(config=LossScaleConfig(init_scale=2.0**10, master_weights=masters))
        sides.append((params, OPTIMIZERS[kind](params), scaler))
    return sides


def _step(side, grads, clip: float | None) -> None:
    params, opt, scaler = side
    for p, g in zip(params, grads, strict=True):
        p.grad = g.to(p.dtype, copy=True)
    scaler.scale(torch.ones(()))
    if clip is not None:
        scaler.clip_grad_norm_(opt, clip)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int16 if t.element_size() == 2 else torch.int32)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["", "clip"])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_the_scalers_step_on_masters_is_torchs_step_on_fp32_weights_bitwise(monkeypatch, kind, clip, threads):
    """Five steps, the third overflowing, through `scaler.step` as a user calls it: after each, every
    master, moment, momentum buffer and step counter equals torch's optimizer's (fused Adam/AdamW,
    for-loop or foreach SGD) on FP32 weights bitwise, and each
    FP16 weight is its master rounded to nearest; the kernel really ran, once per step. Bugs caught: a
    fused multiply-add placed differently from torch's build, a tail cut at another width, an item of
    work cut mid-tensor, a skipped step that writes, a counter not taken back, the clip's factor or the
    grad_scale division left out, the FP16 weight not written."""
    calls = []
    real = cpu_kernel.run
    monkeypatch.setattr(cpu_kernel, "run", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fp32, masters = _sides(kind)
        gen = torch.Generator().manual_seed(1)
        for step in range(5):
            grads = [(torch.randn(s, generator=gen) * 2.0**-3).half().float() for s in SHAPES]
            for g in grads:
                g.view(-1)[::5] = 0.0
            if step == 2:
                grads[4].view(-1)[3] = float("inf")
            for side in (fp32, masters):
                _step(side, grads, clip)
            opt32, opt16 = fp32[1], masters[1]
            for i, (p32, p16) in enumerate(zip(fp32[0], masters[0], strict=True)):
                master = opt16._hf_lossscale_masters.master_of(p16)
                assert torch.equal(_bits(master), _bits(p32)), f"step {step}, master {i}"
                assert torch.equal(_bits(p16), _bits(p32.detach().half())), f"step {step}, weight {i}"
                s32, s16 = opt32.state[p32], opt16.state[master]
                assert set(s32) == set(s16)
                for key in s32:
                    assert torch.equal(_bits(s32[key]), _bits(s16[key])), f"step {step}, {key} {i}"
        assert masters[2].stats()["skipped_steps"] == fp32[2].stats()["skipped_steps"] == 1
        assert len(calls) == CALLS.get(kind, 5)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_the_probe_finds_a_kernel_that_rounds_otherwise(monkeypatch):
    """The probe can fail: the kernel with its scalar tail cut at 16 elements (torch's vector width on
    AVX-512, not where torch 2.13's builds switch to scalar code) differs from torch's fused kernel, and
    the probe says where. Bug caught: a probe that compares nothing, or to a tolerance."""
    lib, why = cpu_kernel._library()
    assert why is None and cpu_kernel._probe(lib) is None
    monkeypatch.setattr(cpu_kernel, "_TAIL", {"AVX2": 16, "AVX512": 16})
    found = cpu_kernel._probe(lib)
    assert found is not None and "elements" in found


def _fused_adamw_step_is_torchs() -> None:
    (fp32, masters) = _sides("adamw")
    gen = torch.Generator().manual_seed(2)
    grads = [(torch.randn(s, generator=gen) * 2.0**-3).half().float() for s in SHAPES]
    for side in (fp32, masters):
        _step(side, grads, None)
    for p32, p16 in zip(fp32[0], masters[0], strict=True):
        assert torch.equal(masters[1]._hf_lossscale_masters.master_of(p16), p32)


def test_without_a_compiler_the_chunked_update_steps(monkeypatch, tmp_path, fresh_kernel):
    """No compiler (CC names a program that fails): the reason says the build failed, nothing is left in
    the cache folder, and a fused AdamW step on masters still equals torch's (the chunked update).
    Bug caught: a failed build that raises out of the step, or leaves a half-written library behind."""
    cc = tmp_path / "cc"  # answers --version, fails to compile (after writing part of its output)
    cc.write_text('#!/bin/sh\n[ "$1" = --version ] && echo cc 1.0 && exit 0\n'
                  'for a; do [ "$p" = -o ] && out=$a; p=$a; done\n'
                  'echo half > "$out"; echo "cc: error: no" >&2; exit 1\n')  # fmt: skip
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    why = cpu_kernel.reason()
    if platform.machine() == "x86_64" and {"avx2", "fma", "f16c"} <= cpu_kernel._cpu_flags():
        assert why is not None and why.startswith("the kernel did not build") and "cc: error: no" in why
        assert [p.name for p in (tmp_path / "hf_lossscale").iterdir()] == []
    assert why is not None
    _fused_adamw_step_is_torchs()


def test_the_variable_turns_the_kernel_off(monkeypatch, fresh_kernel):
    calls = []
    monkeypatch.setattr(cpu_kernel, "run", lambda *a, **k: calls.append(1))
    monkeypatch.setenv(cpu_kernel.ENV, "0")
    assert cpu_kernel.reason() == f"{cpu_kernel.ENV}=0"
    _fused_adamw_step_is_torchs()
    assert calls == []


@needs_kernel
def test_the_build_is_kept_and_reused(monkeypatch, tmp_path, fresh_kernel):
    """A second process finds the library built by the first (named by the source's hash), and no
    temporary file stays beside it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = cpu_kernel._build()
    stamp = first.stat().st_mtime_ns
    assert cpu_kernel._build() == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]


def test_the_kernel_is_not_taken_for_what_it_does_not_compute(fresh_kernel):
    """A foreach (not fused) group on a CPU, and tensor betas, go to the chunked update (its arithmetic is
    not the fused kernel's)."""
    from hf_lossscale.masters.kernel import OnePassSlot, one_pass_reason

    key = torch.zeros(4, requires_grad=True)
    slot = OnePassSlot(
        key, torch.zeros(4, dtype=torch.float16), None, torch.zeros(4), torch.zeros(4, dtype=torch.float16)
    )
    foreach = torch.optim.AdamW([key], foreach=True)
    assert "not fused=True" in one_pass_reason(foreach, foreach.param_groups[0], [slot])
    betas = torch.optim.AdamW([key], fused=True, betas=(torch.tensor(0.9), torch.tensor(0.99)))
    assert one_pass_reason(betas, betas.param_groups[0], [slot]) == "tensor betas"
    fused = torch.optim.AdamW([key], fused=True)
    assert one_pass_reason(fused, fused.param_groups[0], [slot]) == cpu_kernel.reason()


@needs_kernel
@pytest.mark.parametrize("kind", ["adamw", "sgd_momentum"])
def test_what_the_kernel_writes_is_told_to_autograd(monkeypatch, kind):
    """A graph that saved an FP16 weight refuses its backward after a step, as after torch's own
    in-place step: the kernel writes through addresses, so it moves the version counters itself. Bug
    caught: a kernel whose writes autograd does not see (a backward through the old graph then runs on
    the new weights, silently)."""
    calls = []
    real = cpu_kernel.run
    monkeypatch.setattr(cpu_kernel, "run", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    _, (params, opt, scaler) = _sides(kind)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):  # (SGD's first step makes its buffers in the chunked update)
        x = torch.randn(SHAPES[3], generator=gen).half().requires_grad_()
        saved = (x * params[3]).sum()  # mul saves the weight for x's gradient
        _step(
            (params, opt, scaler),
            [(torch.randn(s, generator=gen) * 2.0**-3).half().float() for s in SHAPES],
            None,
        )
    assert calls == ([1] if kind.startswith("sgd") else [1, 1])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


def test_the_variable_is_not_taken_for_a_scaler_setting(monkeypatch):
    """`HF_LOSSSCALE_CPU_KERNEL=0` beside the config loader (Accelerate's hook and the Trainer read
    `HF_LOSSSCALE_*`): not an unknown setting. Bug caught (helper-12): the switch made
    `install_loss_scaler` and `LossScaleTrainingArguments` raise."""
    from hf_lossscale.core.config import config_from_env

    monkeypatch.setenv(cpu_kernel.ENV, "0")
    assert config_from_env() == {}


@needs_kernel
def test_a_step_under_another_default_device_reads_cpu_addresses(tmp_path):
    """`scaler.step` inside `with torch.device("meta")` (the probe and the per-step table made there):
    the kernel still gets CPU addresses. In a child process, since the bug is a segfault. Bug caught
    (helper-12): the table and the probe's tensors made on the default device (exit code 139)."""
    script = tmp_path / "step.py"
    script.write_text(
        "import torch\n"
        "from hf_lossscale import DynamicLossScaler, LossScaleConfig\n"
        "from hf_lossscale.masters import cpu_kernel\n"
        "calls = []\n"
        "real = cpu_kernel.run\n"
        "cpu_kernel.run = lambda *a, **k: (calls.append(1), real(*a, **k))[1]\n"
        "lin = torch.nn.Linear(64, 64).half()\n"
        "opt = torch.optim.AdamW(lin.parameters(), lr=1e-3, fused=True)\n"
        "scaler = DynamicLossScaler(config=LossScaleConfig(init_scale=256.0))\n"
        "for _ in range(2):\n"
        "    scaler.scale(lin(torch.randn(4, 64).half()).float().pow(2).mean()).backward()\n"
        "    with torch.device('meta'):\n"
        "        scaler.step(opt)\n"
        "    scaler.update()\n"
        "    opt.zero_grad()\n"
        "assert cpu_kernel.reason() is None and calls == [1, 1], (cpu_kernel.reason(), calls)\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
