"""Device values read on the host without waiting for the device.

`HostCopy(tensor)` queues a non-blocking copy into host memory (pinned on CUDA) and records an
event; `ready()` asks the event without blocking and `value()` reads the copy once it has landed.
On the CPU the copy is immediate. The scaler reads its counters and overflow flags this way, so a
training step never waits for the GPU.
"""

from __future__ import annotations

from typing import Any

import torch


def tracing_or_capturing() -> bool:
    """Inside torch.compile's tracing, or a CUDA graph capture: no host work may run."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class HostCopy:
    def __init__(self, tensor: torch.Tensor) -> None:
        device = tensor.device
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=device.type == "cuda")
        host.copy_(tensor.detach(), non_blocking=device.type != "cpu")
        self._host = host
        self._event: Any = None
        if device.type != "cpu":
            self._event = torch.Event(device.type)
            self._event.record()

    def ready(self) -> bool:
        """Whether the copy has landed (never blocks)."""
        return self._event is None or bool(self._event.query())

    def value(self) -> Any:
        """The copied value as Python numbers; only once `ready()`."""
        if not self.ready():
            raise RuntimeError("HostCopy.value() before the copy landed; ask ready() first.")
        return self._host.tolist()
