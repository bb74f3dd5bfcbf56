"""Count host reads of device scalars (`aten._local_scalar_dense`), the CPU proxy of a CUDA sync:
how the tests and `benchmarks/step_overhead.py` check that scaling adds none. Not imported by
`hf_lossscale`."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CountScalarReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def count_reads(fn) -> int:
    with CountScalarReads() as counter:
        fn()
    return counter.count
