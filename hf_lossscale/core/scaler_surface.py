"""torch.amp.GradScaler's surface beyond the protocol, for `DynamicLossScaler`: its public getters and
setters of the rule's factors, and the private names that code written against torch's class reaches
(optimizers taking `grad_scaler=`, FSDP's sharded scaler, Lightning, torch's own tests), each a
delegation to the scaler's own state and methods. A mixin: `DynamicLossScaler(TorchSurface,
torch.amp.GradScaler)`, so none of torch's implementation runs (tests/test_torch_gradscaler_contract.py).

Imports only torch.
"""

from __future__ import annotations

from typing import Any

import torch

from . import update_rule as rule

__all__ = ["TorchSurface"]


class TorchSurface:
    """torch's `GradScaler` names that are not the protocol; `DynamicLossScaler` provides `config`,
    `state`, `is_enabled`, `_require_init`, `_read_grads`, `_check` and `_per_optimizer_states`."""

    # ------------------------------------------------------------------ the rule's factors
    def get_growth_factor(self) -> float:
        return self.config.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self.config = self.config.replace(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        return self.config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self.config = self.config.replace(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        return self.config.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self.config = self.config.replace(growth_interval=new_interval)
        rule.clamp_growth_tracker(self.config, self.state)

    # ------------------------------------------------------------------ its private names
    # The private names of torch's GradScaler that code written against it reaches (optimizers taking
    # `grad_scaler=`, FSDP's sharded scaler, Lightning, torch's tests), each a delegation to ours;
    # `_per_optimizer_states` is an attribute (see __init__).
    @property
    def _scale(self) -> torch.Tensor | None:
        return self.state["scale"] if self.state.materialised else None

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        return self.state["_growth_tracker"] if self.state.materialised else None

    @property
    def _enabled(self) -> bool:
        return self.is_enabled()

    @property
    def _init_growth_tracker(self) -> int:
        """torch's name for the growth tracker a scaler starts from: here the current one (a sync)."""
        return self._get_growth_tracker()

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        self.state.set("_growth_tracker", int(value))
        rule.clamp_growth_tracker(self.config, self.state)

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        if not self.state.materialised:
            self.state.materialise(torch.device(dev))

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        self._require_init(funcname)
        return self._scale, self.state["_growth_tracker"]

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor | None = None,
        allow_fp16: bool | None = None,
    ) -> dict[torch.device, torch.Tensor]:
        return self._read_grads(optimizer, inv_scale, found_inf, bool(allow_fp16))

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._check(optimizer)

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        """torch's helper: step unless a found-inf flag is set (reads the flags: one host sync)."""
        skip = sum(v.item() for v in optimizer_state["found_inf_per_device"].values())
        return None if skip else optimizer.step(*args, **kwargs)

    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def _get_growth_tracker(self) -> int:
        return self.state.value("_growth_tracker")
