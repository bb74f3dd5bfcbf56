"""The emulation's op policies against their oracles, op by op.

- `policy="cpu"` against real `torch.autocast("cpu", dtype=torch.float16)`: output dtype, values
  and input gradients, for every sampled op with FP32, FP16 and mixed inputs. A torch upgrade that
  changes CPU autocast fails here.
- `policy="cuda"` against `tests/autocast_tables.py` (torch 2.13's header and documentation),
  which is itself checked against the installed torch's `autocast_mode.h`.
- Coverage: every op the policies name and every op of the CUDA tables has a sample in
  `tests/autocast_ops.py` or a stated reason in `NOT_CALLED`.
"""

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from autocast_ops import NOT_CALLED, SAMPLES
from autocast_tables import HEADER, cuda_table

from hf_lossscale import fp16_emulation
from hf_lossscale.fp16.emulation import FP16_OPS_BY_POLICY, POLICIES

HEADER_FILE = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"


def tagged(t) -> bool:
    return bool(getattr(t, "_hf_fp16", False))


def fp16(x: torch.Tensor) -> torch.Tensor:
    """`x` as FP16 under autocast (real or emulated): the output of a linear layer."""
    return F.linear(x, torch.eye(x.shape[-1]))


def _macro(text: str, macro: str) -> list[str]:
    start = text.index(f"#define {macro}(_)")
    block = text[start : text.index("\n\n", start)].replace("\\\n", " ")
    return re.findall(r"_\(\s*([A-Za-z0-9_]+)", block)


def test_cuda_table_is_the_installed_torchs():
    """Bug caught: a torch upgrade moving an op between CUDA autocast lists, unnoticed."""
    if not HEADER_FILE.exists():
        pytest.skip(f"{HEADER_FILE} is not in this torch wheel")
    text = HEADER_FILE.read_text()
    assert sorted(set(_macro(text, "AT_FORALL_LOWER_PRECISION_FP"))) == sorted(HEADER["fp16"])
    fp32 = set(_macro(text, "AT_FORALL_FP32") + _macro(text, "AT_FORALL_FP32_SET_OPT_DTYPE"))
    assert "ADD_NS(norm)" in text.replace(" ", "")
    assert sorted(fp32 | {"norm"}) == sorted(HEADER["fp32"])
    assert sorted(set(_macro(text, "AT_FORALL_PROMOTE"))) == sorted(HEADER["promote"])


def test_every_named_op_has_a_sample_or_a_reason():
    named = set(cuda_table())
    for policy in POLICIES:
        named |= set(POLICIES[policy]) | set(FP16_OPS_BY_POLICY[policy])
    missing = sorted(named - set(SAMPLES) - set(NOT_CALLED))
    assert not missing, f"no sample and no reason for {missing}"
    assert not set(SAMPLES) & set(NOT_CALLED)


CUDA_CASES = sorted(name for name in cuda_table() if name in SAMPLES)


@pytest.mark.parametrize("name", CUDA_CASES)
def test_cuda_policy_follows_the_table(name):
    """FP16 list: FP32 inputs are cast down. FP32 list: FP16 inputs give FP32. Promote: all-FP16
    inputs stay FP16, a mixture gives FP32. Bug caught: an op missing from the policy's tables
    under the name the emulation sees (the `linalg_` names, `softmin`, `rms_norm`, ...)."""
    kinds, fn = cuda_table()[name], SAMPLES[name]
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    with fp16_emulation("cuda"):
        if "fp16" in kinds:
            assert tagged(fn(a, b)), "FP16 list: should run in FP16"
        if "fp32" in kinds:
            assert not tagged(fn(fp16(a), fp16(b))), "FP32 list: should run in FP32"
        if "promote" in kinds:
            assert tagged(fn(fp16(a), fp16(b))), "promote: all FP16 inputs should stay FP16"
            assert not tagged(fn(fp16(a), b)), "promote: a mixture should give FP32"


def _run(fn, inputs: str, context):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 8, generator=g).requires_grad_()
    b = torch.randn(4, 8, generator=g).requires_grad_()
    with context:
        x = fp16(a) if inputs in ("fp16", "mixed") else a
        y = fp16(b) if inputs == "fp16" else b
        out = fn(x, y)
        if out.requires_grad:
            (out.float() * torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)).sum().backward()
    return out, [t.grad for t in (a, b)]


@pytest.mark.parametrize("inputs", ["fp32", "fp16", "mixed"])
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_cpu_policy_matches_cpu_autocast(name, inputs):
    """Output dtype, values and gradients of `policy="cpu"` against real CPU autocast, op by op.
    Bug caught: a policy entry that CPU autocast does not have (or lacks one it has), which would
    round where real FP16 does not, or keep precision it loses."""
    fn = SAMPLES[name]
    try:
        real, real_grads = _run(fn, inputs, torch.autocast("cpu", dtype=torch.float16))
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"real CPU autocast refuses it: {str(err).splitlines()[0][:100]}")
    emul, emul_grads = _run(fn, inputs, fp16_emulation("cpu"))
    assert tagged(emul) == (real.dtype == torch.float16), f"real {real.dtype}, emulated tag {tagged(emul)}"
    torch.testing.assert_close(emul.float(), real.float(), rtol=1e-2, atol=1e-2, equal_nan=True)
    for e, r in zip(emul_grads, real_grads, strict=True):
        assert (e is None) == (r is None)
        if r is not None:
            torch.testing.assert_close(e, r.float(), rtol=2e-2, atol=2e-2, equal_nan=True)
