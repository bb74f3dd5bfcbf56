"""What distributed training hands the scaler, read in one place: DTensor gradients (FSDP2) and the
one collective the scaler adds, a MAX over the ranks (the found-inf flag, the loss flag).

DTensors are recognised by their attributes, so importing this module does not import
`torch.distributed.tensor`. Imports only torch.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["all_reduce_max", "is_dtensor", "local_shard", "world_size"]


def is_dtensor(tensor: Any) -> bool:
    """Whether `tensor` is a DTensor (FSDP2's parameters and gradients)."""
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "to_local") and hasattr(tensor, "full_tensor")


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def world_size(group: Any = None) -> int:
    """The number of ranks in `group` (the world by default); 1 without an initialised process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def all_reduce_max(flag: torch.Tensor, group: Any = None) -> torch.Tensor:
    """`flag`, in place, as the maximum of every rank's `flag` in `group`: one all-reduce, queued on the
    flag's device (no host sync). Every rank of the group must call it. Returns `flag`."""
    import torch.distributed as dist

    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag
