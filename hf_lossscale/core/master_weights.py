"""FP32 master weights for trainable FP16 parameters: the classic design of loss scaling.

A model held in FP16 (loaded in its checkpoint's dtype, or cast with `.half()` for memory) runs its
forward and backward in FP16; the optimizer steps on FP32 copies of its trainable FP16 parameters
(the masters), and the FP16 weights are written from them after each step:

- `attach(optimizer)` replaces, in the optimizer's parameter groups, each trainable FP16 parameter
  by its FP32 master (before the optimizer's first step: its state is then made in FP32). Frozen
  parameters (a PEFT base) get no copy and cost no memory; FP32 parameters (a classifier head,
  `_keep_in_fp32_modules`) stay as they are.
- `gather(optimizer)`: each FP16 gradient is read once, cast into its master's FP32 gradient (the
  FP16 one freed); the scaler then unscales, checks and clips the FP32 gradients as it always does.
- `write_back(optimizer)`: after the step, the FP16 weights from the masters (`copy_`: round to
  nearest, ties to even); the masters' gradients freed. A skipped step leaves the masters as they
  were, and the FP16 weights rewritten from unchanged masters are unchanged: nothing moves.

The masters travel with the optimizer: each is kept in its own state (`optimizer.state[master]
["hf_lossscale_master"]`, the master itself, no copy; added after the first step, as the optimizers
make their state on an empty entry), so `optimizer.state_dict()` and the Trainer's checkpoints carry
them and `load_state_dict()` restores them bitwise (a load hook copies them back in). Imports only
torch.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MasterWeights", "HALF_DTYPES", "STATE_KEY"]

HALF_DTYPES = (torch.float16,)
STATE_KEY = "hf_lossscale_master"


class MasterWeights:
    """The masters of each optimizer `attach` saw (see the module docstring)."""

    def __init__(self) -> None:
        # id(optimizer) -> [(the FP16 parameter, its FP32 master)]
        self._pairs: dict[int, list[tuple[torch.nn.Parameter, torch.nn.Parameter]]] = {}
        self._seen: set[int] = set()  # optimizers looked at for trainable FP16 parameters
        self._keyed: set[int] = set()  # optimizers whose state holds each master (see write_back)

    def prepare(self, optimizer: torch.optim.Optimizer) -> None:
        """Masters for the optimizer's trainable FP16 parameters the first time it is seen (none when it
        has none), then this iteration's FP16 gradients read into them."""
        inner = _inner(optimizer)
        if id(inner) not in self._seen:
            self._seen.add(id(inner))
            if self.half_trainable(inner):
                self.attach(inner)
        self.gather(inner)

    # ------------------------------------------------------------------ attach
    @staticmethod
    def half_trainable(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
        """The optimizer's trainable parameters held in FP16."""
        return [
            p
            for g in optimizer.param_groups
            for p in g["params"]
            if p.dtype in HALF_DTYPES and p.requires_grad
        ]

    def attached(self, optimizer: torch.optim.Optimizer) -> bool:
        return id(_inner(optimizer)) in self._pairs

    def attach(self, optimizer: torch.optim.Optimizer) -> int:
        """Put FP32 masters in place of the optimizer's trainable FP16 parameters; returns how many.
        Idempotent. Raises `ValueError` when one of them already has optimizer state (the optimizer
        stepped in FP16 before: its moments would be FP16)."""
        inner = _inner(optimizer)
        if id(inner) in self._pairs:
            return 0
        halves = self.half_trainable(inner)
        sharded = [type(p).__name__ for p in halves if type(p).__name__ in ("DTensor", "FlatParameter")]
        if sharded:
            raise ValueError(
                f"master_weights: the optimizer holds sharded FP16 parameters ({sharded[0]}): under FSDP keep "
                "the parameters in FP32 and let FSDP compute in FP16 (FSDP2 `MixedPrecisionPolicy(param_dtype="
                "torch.float16)`, FSDP1 `MixedPrecision(param_dtype=torch.float16)`), which is the same design; "
                "under DeepSpeed use its FP16 optimizer (`fp16.enabled`), which keeps FP32 masters itself."
            )
        stepped = [p for p in halves if inner.state.get(p)]
        if stepped:
            raise ValueError(
                f"master_weights: {len(stepped)} FP16 parameter(s) already have optimizer state (the optimizer "
                "stepped on FP16 weights): attach the masters before the first step."
            )
        pairs = []
        with torch.no_grad():
            for group in inner.param_groups:
                params = group["params"]
                for i, half in enumerate(params):
                    if half.dtype in HALF_DTYPES and half.requires_grad:
                        master = torch.nn.Parameter(half.detach().float())
                        if half.grad is not None:  # a backward already ran: its gradient moves too
                            master.grad = half.grad.float()
                            half.grad = None
                        params[i] = master
                        pairs.append((half, master))
        self._pairs[id(inner)] = pairs
        self._seen.add(id(inner))
        if pairs:
            inner.register_load_state_dict_post_hook(_restore_masters)
        return len(pairs)

    def pairs(self, optimizer: torch.optim.Optimizer) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        return self._pairs.get(id(_inner(optimizer)), [])

    # ------------------------------------------------------------------ each step
    def gather(self, optimizer: torch.optim.Optimizer) -> None:
        """Each FP16 gradient cast into its master's FP32 gradient (one read of it), then freed."""
        halves, masters = [], []
        for half, master in self.pairs(optimizer):
            if half.grad is None:
                continue
            if master.grad is None:  # freed after each step (write_back / release)
                master.grad = torch.empty_like(master)
            halves.append(half.grad)
            masters.append(master.grad)
            half.grad = None
        if masters:
            with torch.no_grad():
                torch._foreach_copy_(masters, halves)

    def write_back(self, optimizer: torch.optim.Optimizer) -> None:
        """The FP16 weights from the masters (round to nearest even); the masters' gradients freed."""
        pairs = self.pairs(optimizer)
        if not pairs:
            return
        with torch.no_grad():
            torch._foreach_copy_([h for h, _ in pairs], [m for _, m in pairs])
        for _, master in pairs:
            master.grad = None
        inner = _inner(optimizer)
        if id(inner) not in self._keyed and all(inner.state.get(m) for _, m in pairs):
            # once the optimizer made its own state (its first step: it makes it on an empty entry)
            for _, master in pairs:
                inner.state[master][STATE_KEY] = master
            self._keyed.add(id(inner))

    def release(self, optimizer: torch.optim.Optimizer) -> None:
        """After a skipped step: the masters' gradients freed (masters and weights untouched)."""
        for _, master in self.pairs(optimizer):
            master.grad = None

    def bytes(self) -> int:
        """The masters' memory (4 bytes per trainable FP16 parameter)."""
        return sum(m.numel() * m.element_size() for pairs in self._pairs.values() for _, m in pairs)


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's `AcceleratedOptimizer` (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def _restore_masters(optimizer: torch.optim.Optimizer) -> None:
    """After `load_state_dict`: each master's state entry is a loaded copy; its values go into the
    master (bitwise) and the entry points at the master again."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param)
                loaded = state.get(STATE_KEY) if state else None
                if loaded is not None and loaded is not param:
                    param.copy_(loaded)
                    state[STATE_KEY] = param
