"""The one-pass masters' Adam/AdamW step on an x86-64 CPU (issue 56): `cpu_adam.c`, built with the
system's C compiler at first use and loaded with ctypes.

torch's fused CPU kernel takes one dtype, so on FP16 parameters with FP32 masters it needs an FP32 copy
of each gradient before it and an FP16 write of each weight after it: the chunked update of
`masters.step` runs those three passes bucket by bucket (x1.5 of FP32 weights' step on an AVX-512 Xeon,
x1.3 on an AVX2 EPYC). This kernel reads the FP16 gradient and writes the FP16 weight in the same pass
as the update, with torch's fused arithmetic, for fused Adam/AdamW groups.

It is used only where it gives torch's results bitwise: before its first use a probe runs it beside
torch's `_fused_adam_`/`_fused_adamw_` on FP32 copies (every option it takes, tensors with and without
a scalar tail) and the kernel is set aside if anything differs. Where there is no compiler, no AVX2,
FMA and F16C, torch's CPU capability is neither AVX2 nor AVX-512 (the vector width its scalar tail
follows), or `HF_LOSSSCALE_CPU_KERNEL=0`, the chunked update runs instead; `reason()` says why.

The build goes to `$XDG_CACHE_HOME/hf_lossscale` (else `~/.cache/hf_lossscale`), named by a hash of
the source, the flags and the compiler, written to a temporary name and renamed (several processes may
build at once). Imports only torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = ["ENV", "fp32_like", "mark_written", "reason", "run", "step"]

#: The variable that turns the kernel off ("0").
ENV = "HF_LOSSSCALE_CPU_KERNEL"
_FLAGS = ["-O2", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fPIC", "-shared", "-pthread"]
_SOURCE = Path(__file__).with_name("cpu_adam.c")
#: torch's vector width in floats per CPU capability: its scalar tail is numel % this
_TAIL = {"AVX2": 8, "AVX512": 8}


class _Args(ctypes.Structure):
    _fields_ = [
        ("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
        ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double),
        ("decoupled", ctypes.c_int64), ("amsgrad", ctypes.c_int64), ("maximize", ctypes.c_int64),
        ("tail_width", ctypes.c_int64), ("grad_scale", ctypes.c_void_p), ("found_inf", ctypes.c_void_p),
    ]  # fmt: skip


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hf_lossscale"


def _build() -> Path:
    """The shared library, built if this source, these flags and this compiler have none yet."""
    compiler = os.environ.get("CC", "cc")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=True)
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(_FLAGS).encode() + version.stdout.encode()).hexdigest()[:16]
    folder = _cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder, delete=True)
        probe.close()
    except OSError:
        folder = Path(tempfile.gettempdir()) / f"hf_lossscale-{os.getuid() if hasattr(os, 'getuid') else 0}"
        folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"cpu_adam-{digest}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".cpu_adam-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120,
            check=True,
        )  # fmt: skip
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    """The loaded kernel, or None and why not."""
    if os.environ.get(ENV, "1").strip() == "0":
        return None, f"{ENV}=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"not an x86-64 CPU ({platform.machine()})"
    missing = {"avx2", "fma", "f16c"} - _cpu_flags()
    if missing:
        return None, f"the CPU lacks {', '.join(sorted(missing))} (or /proc/cpuinfo does not say)"
    if torch.backends.cpu.get_cpu_capability() not in _TAIL:
        return None, f"torch's CPU capability is {torch.backends.cpu.get_cpu_capability()}"
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", None) or str(err)
        return None, f"the kernel did not build or load: {detail.strip()[:300]}"
    for name, args in (("hf_adam_fp16", _Args), ("hf_sgd_fp16", _SgdArgs)):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(args), ctypes.c_int64, ctypes.c_void_p]
    with torch.device("cpu"):  # (the probe's tensors on the CPU, whatever the default device)
        mismatch = _probe(lib) or _probe_sgd(lib)
    if mismatch is not None:
        return None, f"it differs from torch's kernels on this machine ({mismatch})"
    return lib, None


def reason() -> str | None:
    """None when the kernel runs here; otherwise why not (in words)."""
    return _library()[1]


class _SgdArgs(ctypes.Structure):
    _fields_ = [
        ("lr", ctypes.c_double), ("momentum", ctypes.c_double), ("dampening", ctypes.c_double),
        ("weight_decay", ctypes.c_double), ("nesterov", ctypes.c_int64), ("maximize", ctypes.c_int64),
        ("tail_width", ctypes.c_int64),
    ]  # fmt: skip


def _call(lib: ctypes.CDLL, kind: str, rows: list, **o) -> None:
    """One call over `rows`: (FP16 gradient, factor or None, FP32 master, state, FP16 weight); Adam's
    counters already moved, SGD's momentum buffers (where momentum is on) all there."""
    adam = kind == "adam"
    # an `hf_slot` per row: grad, factor, master, exp_avg, exp_avg_sq, max_exp_avg_sq, weight, step, numel
    # (SGD's momentum buffer in exp_avg's place)
    if adam:
        keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq" if o["amsgrad"] else None, "step")
    else:
        keys = ("momentum_buffer", None, None, None)

    def address(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    table = torch.tensor(
        [(g.data_ptr(), address(f), m.data_ptr(), *(address(st.get(k)) if k else 0 for k in keys[:3]),
          w.data_ptr(), address(st.get(keys[3])) if keys[3] else 0, m.numel()) for g, f, m, st, w in rows],
        dtype=torch.int64,
        device="cpu",  # (the C code reads it: on the CPU whatever the default device)
    )  # fmt: skip
    first = torch.empty(len(rows) + 1, dtype=torch.int64, device="cpu")
    tail = _TAIL[torch.backends.cpu.get_cpu_capability()]
    if adam:
        args = _Args(
            o["lr"], o["beta1"], o["beta2"], o["eps"], o["weight_decay"], int(o["decoupled"]), int(o["amsgrad"]),
            int(o["maximize"]), tail, address(o["grad_scale"]), address(o["found_inf"]),
        )  # fmt: skip
        status = lib.hf_adam_fp16(
            table.data_ptr(), len(rows), ctypes.byref(args), torch.get_num_threads(), first.data_ptr()
        )
    else:
        args = _SgdArgs(o["lr"], o["momentum"], o["dampening"], o["weight_decay"], int(o["nesterov"]),
                        int(o["maximize"]), tail)  # fmt: skip
        status = lib.hf_sgd_fp16(
            table.data_ptr(), len(rows), ctypes.byref(args), torch.get_num_threads(), first.data_ptr()
        )
    if status:
        raise RuntimeError(f"masters.cpu_kernel: the kernel refused its arguments (status {status})")


def fp32_like(t: torch.Tensor | None, master: torch.Tensor) -> bool:
    """Whether a state tensor is what a one-pass kernel reads beside `master`: contiguous FP32 of its
    shape on its device."""
    return (
        t is not None and t.dtype == torch.float32 and t.shape == master.shape and t.is_contiguous()
        and t.device == master.device
    )  # fmt: skip


def step(
    optimizer: torch.optim.Optimizer,
    group: dict,
    slots: list,
    state_of,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> bool:
    """`masters.kernel.run_one_pass` on a CPU: one call for the group (`slots` are its `OnePassSlot`s,
    `state_of(key)` the optimizer's state for a key). Adam's counters move as torch's fused Adam moves
    them (+1, and back by `found_inf`). False, with nothing done (the chunked update then steps): a
    state tensor that is not a contiguous FP32 tensor of its master's shape (an SGD step before its
    momentum buffers exist among them), or a counter, `grad_scale` or `found_inf` that is not one FP32
    number on the CPU; SGD handed either (torch's for-loop SGD takes neither)."""
    states = [state_of(s.key) for s in slots]
    if type(optimizer) is torch.optim.SGD:
        if grad_scale is not None or found_inf is not None:
            return False
        if group["momentum"] != 0 and not all(
            fp32_like(st.get("momentum_buffer"), s.master) for s, st in zip(slots, states, strict=True)
        ):
            return False
        rows = [(s.grad, s.factor, s.master, st, s.weight) for s, st in zip(slots, states, strict=True)]
        with torch.no_grad():
            run("sgd", rows, lr=float(group["lr"]), momentum=float(group["momentum"]),
                dampening=float(group["dampening"]), weight_decay=float(group["weight_decay"]),
                nesterov=bool(group["nesterov"]), maximize=bool(group["maximize"]))  # fmt: skip
        mark_written(slots, states, ("momentum_buffer",) if group["momentum"] != 0 else ())
        return True
    moments = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")
    if not all(fp32_like(st.get(k), s.master) for s, st in zip(slots, states, strict=True) for k in moments):
        return False
    steps = [st["step"] for st in states]
    scalars = [*steps, *(t for t in (grad_scale, found_inf) if t is not None)]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or t.numel() != 1 for t in scalars):
        return False
    beta1, beta2 = group["betas"]
    with torch.no_grad():
        torch._foreach_add_(steps, 1)
        run(
            "adam", [(s.grad, s.factor, s.master, st, s.weight) for s, st in zip(slots, states, strict=True)],
            lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            decoupled=group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW),
            amsgrad=bool(group["amsgrad"]), maximize=bool(group["maximize"]), grad_scale=grad_scale,
            found_inf=found_inf,
        )  # fmt: skip
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))
    mark_written(slots, states, moments)
    return True


def mark_written(slots: list, states: list[dict], keys: tuple[str, ...]) -> None:
    """The tensors the kernel wrote through their addresses, told to autograd as torch's in-place ops
    tell it (their version counters move: a graph that saved one refuses to run backward on it, as
    after torch's own step; torch's fused kernel moves them on a step it skips too)."""
    torch.autograd.graph.increment_version(
        [t for s, st in zip(slots, states, strict=True) for t in (s.master, s.weight, *(st[k] for k in keys))]
    )


def run(kind: str, rows: list, **options) -> None:
    """The kernel's `kind` ("adam" or "sgd") step over `rows` (see `_call`); `reason()` must be None."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"masters.cpu_kernel: not available: {why}")
    _call(lib, kind, rows, **options)


def _probe(lib: ctypes.CDLL) -> str | None:
    """Where the kernel and torch's fused kernel disagree on FP32 copies of the same tensors (None: bitwise
    the same everywhere): each option, lengths with and without a scalar tail, three steps, a skip."""
    gen = torch.Generator().manual_seed(0)
    cases = [
        dict(decoupled=True, weight_decay=0.01, amsgrad=False, maximize=False, beta1=0.9),
        dict(decoupled=False, weight_decay=0.1, amsgrad=True, maximize=False, beta1=0.9),
        dict(decoupled=True, weight_decay=0.0, amsgrad=False, maximize=True, beta1=0.3),
        dict(decoupled=False, weight_decay=0.0, amsgrad=True, maximize=True, beta1=0.5),
    ]
    for k, case in enumerate(cases):
        lengths = [1, 7, 8, 15, 16, 17, 31, 64 + 13, 1 << 16, (1 << 16) + 9]
        halves = [(_randn(n, gen) * 0.1).half() for n in lengths]
        masters = [h.float() + _randn(n, gen) * 1e-4 for h, n in zip(halves, lengths, strict=True)]
        ours = [
            {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros(n, dtype=torch.float32), "exp_avg_sq": torch.zeros(n, dtype=torch.float32),
             "max_exp_avg_sq": torch.zeros(n, dtype=torch.float32)}
            for n in lengths
        ]  # fmt: skip
        ref = [{key: t.clone() for key, t in st.items()} for st in ours]
        ref_masters = [m.clone() for m in masters]
        factors = [
            None if i % 2 else torch.tensor(0.5 ** (i % 5), dtype=torch.float32) for i in range(len(lengths))
        ]
        scale = torch.tensor(2.0 ** (k + 1), dtype=torch.float32)
        for step in range(4):
            grads = [_zeros_in((_randn(n, gen) * 2.0 ** (k - 6)).half()) for n in lengths]
            found = torch.tensor(1.0 if step == 2 else 0.0, dtype=torch.float32)
            options = dict(
                lr=1e-3, beta1=case["beta1"], beta2=0.999, eps=1e-8, weight_decay=case["weight_decay"],
                amsgrad=case["amsgrad"], maximize=case["maximize"],
            )  # fmt: skip
            for st in ours + ref:
                st["step"] += 1
            _call(
                lib, "adam", list(zip(grads, factors, masters, ours, halves, strict=True)), decoupled=case["decoupled"],
                grad_scale=scale, found_inf=found, **options,
            )  # fmt: skip
            kernel = torch._fused_adamw_ if case["decoupled"] else torch._fused_adam_
            ref_grads = [
                g.float() if f is None else g.float() * f for g, f in zip(grads, factors, strict=True)
            ]
            kernel(
                ref_masters, ref_grads, [st["exp_avg"] for st in ref], [st["exp_avg_sq"] for st in ref],
                [st["max_exp_avg_sq"] for st in ref] if case["amsgrad"] else [], [st["step"] for st in ref],
                grad_scale=scale, found_inf=found, **options,
            )  # fmt: skip
            for st in ours + ref:
                st["step"] -= found
            for i, n in enumerate(lengths):
                pairs = [("master", masters[i], ref_masters[i]), ("weight", halves[i], ref_masters[i].half())]
                pairs += [
                    (key, ours[i][key], ref[i][key]) for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
                ]
                for name, a, b in pairs:
                    if not torch.equal(a.view(torch.int16 if a.dtype == torch.float16 else torch.int32),
                                       b.view(torch.int16 if b.dtype == torch.float16 else torch.int32)):  # fmt: skip
                        return f"case {k}, step {step + 1}, {name} of {n} elements"
    return None


def _probe_sgd(lib: ctypes.CDLL) -> str | None:
    """`_probe` for SGD, against torch's for-loop and foreach SGD on FP32 copies (momentum buffers there)."""
    from torch.optim.sgd import sgd

    gen = torch.Generator().manual_seed(1)
    cases = [
        dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0, maximize=False),
        dict(momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.01, maximize=False),
        dict(momentum=0.5, dampening=0.1, nesterov=False, weight_decay=0.1, maximize=True),
        dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.01, maximize=False),
        dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0, maximize=True),
        dict(momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.0, maximize=True),
    ]
    lengths = [1, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64 + 13, (1 << 16) + 9]
    for k, case in enumerate(cases):
        for foreach in (False, True):
            halves = [(_randn(n, gen) * 0.1).half() for n in lengths]
            masters = [
                _zeros_in(h.float() + _randn(n, gen) * 1e-4, flip=True)
                for h, n in zip(halves, lengths, strict=True)
            ]
            halves = [m.half() for m in masters]
            buffers = [
                _zeros_in(_randn(n, gen) * 1e-3, flip=True) if case["momentum"] else None for n in lengths
            ]
            ref_masters = [m.clone() for m in masters]
            ref_buffers = [b if b is None else b.clone() for b in buffers]
            factors = [
                None if i % 2 else torch.tensor(0.5 ** (i % 5), dtype=torch.float32)
                for i in range(len(lengths))
            ]
            for step in range(3):
                grads = [_zeros_in((_randn(n, gen) * 2.0 ** (k - 6)).half()) for n in lengths]
                states = [{"momentum_buffer": b} for b in buffers]
                _call(
                    lib,
                    "sgd",
                    list(zip(grads, factors, masters, states, halves, strict=True)),
                    lr=1e-2,
                    **case,
                )
                ref_grads = [
                    g.float() if f is None else g.float() * f for g, f in zip(grads, factors, strict=True)
                ]
                sgd(ref_masters, ref_grads, ref_buffers, lr=1e-2, foreach=foreach, grad_scale=None, found_inf=None,
                    has_sparse_grad=False, fused=False, **case)  # fmt: skip
                for i, n in enumerate(lengths):
                    pairs = [
                        ("master", masters[i], ref_masters[i]),
                        ("weight", halves[i], ref_masters[i].half()),
                    ]
                    if buffers[i] is not None:
                        pairs.append(("momentum buffer", buffers[i], ref_buffers[i]))
                    for name, a, b in pairs:
                        if not torch.equal(_raw(a), _raw(b)):
                            return f"SGD case {k}, foreach={foreach}, step {step + 1}, {name} of {n} elements"
    return None


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.float16 else torch.int32)


def _randn(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, generator=gen, dtype=torch.float32)  # (whatever the default dtype)


def _zeros_in(t: torch.Tensor, flip: bool = False) -> torch.Tensor:
    """Exact zeros of each sign at every fifth element (-0 at the even ones with `flip`, so that a
    gradient's zero meets a weight's or a buffer's of either sign): the signs of the zeros the
    arithmetic makes must be torch's too."""
    t[::5] = 0.0
    t[::10] = -0.0 if flip else 0.0
    t[5::10] = 0.0 if flip else -0.0
    return t
