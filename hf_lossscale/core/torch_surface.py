"""The private surface of `torch.amp.GradScaler` that torch's own callers reach: `_scale`,
`_growth_tracker`, `_enabled`, `_init_growth_tracker`, `_lazy_init_scale_growth_tracker`,
`_check_scale_growth_tracker`, `_unscale_grads_` (the one read of the gradients: unscale and check),
`_check_inf_per_device`, `_found_inf_per_device`, `_maybe_opt_step`, `_get_scale_async`,
`_get_growth_tracker`. Optimizers that take `grad_scaler=`, torch's tests and Accelerate call
these; a mixin of `DynamicLossScaler`, apart from its public protocol.
"""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    pass


def fused_sgd_first_step(optimizer: torch.optim.Optimizer) -> bool:
    """A fused SGD with momentum whose momentum buffers do not exist yet (its first step)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    return any(
        group.get("fused")
        and group["momentum"] != 0
        and any(
            p.grad is not None and "momentum_buffer" not in optimizer.state.get(p, {})
            for p in group["params"]
        )
        for group in optimizer.param_groups
    )


def mul_grads_(grouped: dict, factor: torch.Tensor, foreach: bool | None) -> None:
    """Multiply gradients grouped by device and dtype by a 0-d tensor, in place, as torch's
    `clip_grads_with_norm_` does (foreach where supported, else tensor by tensor)."""
    from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support

    for device, per_dtype in grouped.items():
        f = factor.to(device, non_blocking=True)
        for grads in per_dtype.values():
            if (foreach is None and _has_foreach_support(grads, device)) or (
                foreach and _device_has_foreach_support(device)
            ):
                torch._foreach_mul_(grads, f)
            elif foreach:
                raise RuntimeError(
                    f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
                )
            else:
                for g in grads:
                    g.mul_(f)


def takes_grad_scaler(step: Any) -> bool:
    """Whether an optimizer's `step` takes `grad_scaler=` (torch's older contract); the signature is
    read once per step function, not on every step."""
    func = getattr(step, "__func__", step)
    try:
        return _signature_takes_grad_scaler(func)
    except TypeError:  # an unhashable callable: read its signature each time
        return "grad_scaler" in inspect.signature(func).parameters


@functools.lru_cache(maxsize=64)
def _signature_takes_grad_scaler(func: Any) -> bool:
    return "grad_scaler" in inspect.signature(func).parameters


_MAX_NAMES = 8  # parameter names shown in the FP16-parameter error


class TorchGradScalerSurface:
    """torch's private `GradScaler` names, as `DynamicLossScaler` keeps them (module docstring)."""

    @property
    def _scale(self) -> torch.Tensor | None:
        return self.state["scale"] if self.state.materialised else None

    @property
    def _enabled(self) -> bool:
        return self.is_enabled()

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        return self.state["_growth_tracker"] if self.state.materialised else None

    @property
    def _init_growth_tracker(self) -> int:
        """torch's name for the growth tracker a scaler starts from: here the current one (a sync)."""
        return self._get_growth_tracker()

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        if self.state.materialised:
            self.state["_growth_tracker"].fill_(int(value))
        else:
            self.state.host["_growth_tracker"] = int(value)
        self._clamp_growth_tracker()

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        if not self.state.materialised:
            self.state.materialise(torch.device(dev))

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        self._require_init(funcname)
        return self._scale, self.state["_growth_tracker"]

    # ------------------------------------------------------------------ unscale / check
    def _gather_masters(self, optimizer: torch.optim.Optimizer) -> None:
        """With `config.master_weights`: FP32 masters for the optimizer's trainable FP16 parameters (at
        its first step), and this iteration's FP16 gradients read into them (nothing when none)."""
        if self.config.master_weights is not False:
            self.master_weights.prepare(optimizer)

    def _grads_by_device_and_dtype(self, optimizer: torch.optim.Optimizer, allow_fp16: bool = False):
        grouped: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        fp16_params, bf16_params = [], []
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.dtype == torch.float16 and not allow_fp16:
                    fp16_params.append(self.parameter_names.name(param, optimizer))
                    continue
                if param.dtype == torch.bfloat16:
                    bf16_params.append(self.parameter_names.name(param, optimizer))
                    continue
                grad = param.grad
                if grad.is_sparse:
                    if grad.dtype is torch.float16:
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                grouped[grad.device][grad.dtype].append(grad)
        if bf16_params:
            shown = ", ".join(bf16_params[:_MAX_NAMES])
            more = f" (and {len(bf16_params) - _MAX_NAMES} more)" if len(bf16_params) > _MAX_NAMES else ""
            raise ValueError(
                f"{len(bf16_params)} trainable parameter(s) are held in bfloat16: {shown}{more}, under an FP16 loss "
                "scaler (torch's fails on them in a kernel: '_amp_foreach_non_finite_check_and_unscale_cuda' not "
                "implemented for 'BFloat16'). BF16 has FP32's range and needs no loss scaling: train with "
                "bf16=True (mixed_precision='bf16', no scaler), or hold the parameters in FP32 (fp16=True, autocast) "
                "or FP16 (master weights)."
            )
        if fp16_params:
            shown = ", ".join(fp16_params[:_MAX_NAMES])
            more = f" (and {len(fp16_params) - _MAX_NAMES} more)" if len(fp16_params) > _MAX_NAMES else ""
            raise ValueError(
                f"{len(fp16_params)} trainable parameter(s) are held in float16: {shown}{more}. "
                "Loss scaling needs FP32 master weights: load the model in float32 (drop "
                "`torch_dtype=torch.float16` / `dtype=torch.float16` from from_pretrained) and let "
                "autocast (`fp16=True` / `mixed_precision='fp16'`) run the FP16 compute, freeze "
                "those parameters, or let the optimizer step on FP32 master copies of them "
                "(master_weights='auto' or True: --loss_scale_master_weights auto, HF_LOSSSCALE_MASTER_WEIGHTS)."
            )
        return grouped

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor | None = None,
        allow_fp16: bool | None = None,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale in place and fill one found-inf flag per device (no host sync).

        With torch's arguments (`found_inf`, `allow_fp16`, as `GradScaler._unscale_grads_` takes them,
        for code that calls it) the flags accumulate into `found_inf` (a copy of it on other
        devices) without this iteration's loss flag, and `allow_fp16=True` unscales gradients of
        FP16 parameters too; by default FP16 parameters are refused with an explanation.
        """
        found: dict[torch.device, torch.Tensor] = {}
        inv: dict[torch.device, torch.Tensor] = {}

        def flag_for(device: torch.device) -> torch.Tensor:
            if found_inf is None:
                return self._new_found(device)
            return found_inf if found_inf.device == device else found_inf.to(device, non_blocking=True)

        # a non-finite loss poisoned its own gradients (see `scale`): the check sees it through them
        if not allow_fp16:
            self._gather_masters(optimizer)  # the observers see the gradients the optimizer steps on
        for observer in self._watchers():
            observer.before_unscale(self, optimizer)
        with torch.no_grad():
            grouped = self._grads_by_device_and_dtype(optimizer, bool(allow_fp16))
            for device, per_dtype in grouped.items():
                if device not in found:
                    found[device] = flag_for(device)
                    inv[device] = inv_scale.to(device, non_blocking=True)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found[device], inv[device])
        if not found:  # no gradients and no loss: a clean flag on the scale's device
            home = self._scale.device if self._scale is not None else inv_scale.device
            found[home] = flag_for(home)
        if self._found_inf_group is not None:
            import torch.distributed as dist

            flag = torch.stack([f.reshape(()).to(self._scale.device) for f in found.values()]).amax()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._found_inf_group)
            found = {flag.device: flag}
        return found

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """Check for inf/NaN without unscaling (fused optimizers unscale inside their kernel)."""
        self._require_init("step")
        found = self._unscale_grads_(optimizer, self._one(self._scale.device))
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        """torch's helper: step unless a found-inf flag is set (reads the flags: one host sync)."""
        if not sum(v.item() for v in optimizer_state["found_inf_per_device"].values()):
            return optimizer.step(*args, **kwargs)
        return None

    # ------------------------------------------------------------------ reading state
    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def _get_growth_tracker(self) -> int:
        if not self.state.materialised:
            return self.state.host["_growth_tracker"]
        return self.state["_growth_tracker"].item()
