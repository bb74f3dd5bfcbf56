"""torch's own GradScaler tests, run against `DynamicLossScaler` with the GradScaler names rebound.

torch's block lives in pytorch's `test/test_torch.py` (`TestTorchDeviceType`, `test_pickle_gradscaler`
through `test_grad_scaler_deprecated_warning`). Copy it, with that file's imports, into a file outside
this repository (torch's code stays out of ours), instantiate it for the CPU
(`instantiate_device_type_tests(TestTorchDeviceType, globals(), only_for="cpu")`), then:

    pip install expecttest                                   # torch's test utilities need it
    python benchmarks/torch_gradscaler_block.py BLOCK.py -q  # ours: torch.GradScaler, torch.amp.GradScaler
                                                             # and torch.amp.grad_scaler.GradScaler rebound
    REBIND=0 python benchmarks/torch_gradscaler_block.py BLOCK.py -q   # torch's own class, the baseline

The deprecated aliases (`torch.cpu.amp.GradScaler`, `torch.cuda.amp.GradScaler`) stay torch's: their
test checks torch's own deprecation warning. Pickling goes through `DynamicLossScaler`'s own
`__getstate__`/`__setstate__` (its class is what `pickle` records).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or not os.path.isfile(argv[0]):
        print(__doc__)
        return 2
    import pytest
    import torch

    if os.environ.get("REBIND", "1") == "1":
        from hf_lossscale import DynamicLossScaler

        torch.GradScaler = torch.amp.GradScaler = torch.amp.grad_scaler.GradScaler = DynamicLossScaler
        print("GradScaler names bound to", f"{DynamicLossScaler.__module__}.{DynamicLossScaler.__qualname__}")
    return pytest.main([argv[0], "-p", "no:cacheprovider", *argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
