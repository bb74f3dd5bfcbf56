"""Count every way a device value reaches the host: how the tests and `benchmarks/step_overhead.py`
check that scaling adds no synchronisation. Not imported by `hf_lossscale`.

A read is any of `item()`, `tolist()`, `numpy()`, `cpu()`, a blocking `to()` towards the host,
`bool()`, `float()`, `int()`, `index()` of a tensor, seen at the Python level (`TorchFunctionMode`), plus
`aten._local_scalar_dense` calls that C++ code makes on its own (`TorchDispatchMode`). On a CPU-only
run every tensor stands for a device tensor (the CPU proxy of a CUDA sync), except the host copies
the scaler makes on purpose (`hf_lossscale.core.hostcopy.HostCopy`): reading those never waits for a
device. Reads inside Python code that itself runs under a torch function (`F.*`) are seen only
through the dispatch fallback.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from hf_lossscale.core.hostcopy import HostCopy

_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
}


def _to_host_blocking(func, args, kwargs) -> bool:
    """A blocking `to()` towards the host: from another device, or spelled `"cpu"` (a string, the
    way code asks for the host; `to(x.device)` between CPU tensors is device plumbing)."""
    if func is not torch.Tensor.to or kwargs.get("non_blocking") or not args:
        return False
    source = args[0]
    for target in (*args[1:], kwargs.get("device")):
        if isinstance(target, str) and torch.device(target).type == "cpu":
            return True
        if isinstance(target, torch.device) and target.type == "cpu" and source.device.type != "cpu":
            return True
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: CountHostReads) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not self.owner._inside:
            self.owner._count("aten._local_scalar_dense", args[0])
        return func(*args, **(kwargs or {}))


class CountHostReads(TorchFunctionMode):
    """`with CountHostReads() as c: ...` then `c.count` (and `c.reads`: what was read, in order)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.reads: list[str] = []
        self._inside = False
        self._reading_host_copy = False
        self._dispatch = _Dispatch(self)
        self._host_copy_value = None

    def _count(self, what: str, tensor) -> None:
        if self._reading_host_copy:
            return
        self.count += 1
        self.reads.append(what)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        is_read = func in _READS or _to_host_blocking(func, args, kwargs)
        if not is_read:
            return func(*args, **kwargs)
        self._count(getattr(func, "__name__", str(func)), args[0] if args else None)
        saved, self._inside = self._inside, True
        try:
            return func(*args, **kwargs)
        finally:
            self._inside = saved

    def _wrap_host_copies(self) -> None:
        original, owner = HostCopy.value, self

        def value(copy):
            saved, owner._reading_host_copy = owner._reading_host_copy, True
            try:
                return original(copy)
            finally:
                owner._reading_host_copy = saved

        self._host_copy_value = original
        HostCopy.value = value

    def __enter__(self):
        self._wrap_host_copies()
        self._dispatch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._dispatch.__exit__(*exc)
            HostCopy.value = self._host_copy_value


CountScalarReads = CountHostReads  # the earlier name


def count_reads(fn) -> int:
    with CountHostReads() as counter:
        fn()
    return counter.count
