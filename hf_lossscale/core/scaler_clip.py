"""`DynamicLossScaler.clip_grad_norm_`: unscale, check and clip one optimizer's gradients in one read
of them (the method's docstring says what it gives); and the divisor it may leave for a fused kernel,
applied when the gradients are read again before the step.

A part of the scaler (it reads and sets the scaler's per-iteration state), kept in a file of its own
because it is the one place where the clip and the overflow check share a read of the gradients.
Imports only torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from ..masters.weights import grad_for
from . import grad_pass
from .clip import total_norm
from .hostcopy import tracing_or_capturing

__all__ = ["apply_deferred_unscale", "clip_grad_norm"]


def clip_grad_norm(
    scaler: Any,
    optimizer: torch.optim.Optimizer,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    parameters: Iterable[torch.Tensor] | None = None,
) -> torch.Tensor:
    """`scaler.clip_grad_norm_(optimizer, ...)`: see the method."""
    if scaler.state.materialised or not scaler.is_enabled():
        # a model held in FP16: its gradients read for its masters (left FP16 where the step casts
        # them chunk by chunk; the plain paths below cast them)
        scaler._gather_masters(optimizer, defer=True)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if parameters is not None:  # the model's FP16 parameters: their masters
        parameters = [scaler.master_weights.master_of(optimizer, p) for p in parameters]
        given = {id(p) for p in parameters if grad_for(optimizer, p) is not None}
        if given != {id(p) for p in params if grad_for(optimizer, p) is not None}:
            raise ValueError(
                "clip_grad_norm_(parameters=...): the parameters with gradients must be exactly the "
                "optimizer's parameters with gradients (it clips what this optimizer steps)."
            )
        params = parameters
    if not scaler.is_enabled():
        scaler.master_weights.materialise(optimizer)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    scaler._require_init("clip_grad_norm_")
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.STEPPED:
        raise RuntimeError("clip_grad_norm_() is being called after step().")
    norm_type = float(norm_type)
    grads = [grad_for(optimizer, p) for p in params]
    with_grad = [p for p, g in zip(params, grads, strict=True) if g is not None]
    grads = [g for g in grads if g is not None]
    if (
        state["stage"] is OptState.UNSCALED
        or scaler.config.at_min_scale == "clamp"  # unscale_ clamps first: the clip sees the clamped values
        or norm_type not in (2.0, math.inf)
        or scaler._found_inf_group is not None
        or any(g.is_sparse for g in grads)
    ):
        if state["stage"] is OptState.READY:
            scaler.unscale_(optimizer)
        else:
            apply_deferred_unscale(scaler, optimizer, state)
        scaler.master_weights.materialise(optimizer)  # torch's clip reads every `.grad`
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)

    grouped = grad_pass.group_grads(optimizer, scaler.parameter_names.name)  # refuses FP16 parameters
    for observer in scaler._watchers():  # the scaled gradients, as unscale_ shows them
        observer.before_unscale(scaler, optimizer)
    with torch.no_grad():
        scaled_norm, per_tensor = total_norm(grads, norm_type, foreach)
        device = scaled_norm.device if with_grad else scaler._scale.device
        scale = scaler._scale.to(device, non_blocking=True)
        norm = scaled_norm.to(device) / scale  # exact for a power-of-two scale
        # the norm is inf/NaN exactly when a gradient is (a non-finite loss poisoned its own); one
        # kernel checks it (multiplying it by 1 in place leaves its value as it is)
        found, one = scaler.flags.new_found(device, scaler._scale.device), scaler._constants(device).one
        torch._amp_foreach_non_finite_check_and_unscale_([norm], found, one)
        if error_if_nonfinite and found:
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                "so it cannot be clipped. To disable this error and scale the gradients by the "
                "non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)  # torch's formula
        # On an overflow (a non-finite norm) the step is skipped and the gradients keep their values
        # (scaled). (at_min_scale="clamp" took the plain path above.)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # nothing is written: the kernel skips on the flag, whatever the divisor (a caller who
            # reads the gradients before step() gets them unscaled and clipped: see
            # apply_deferred_unscale; on an overflow then, unscaled only)
            state["grad_scale"] = scale / coef
        else:
            multiplier = torch.where(found > 0, one, coef / scale)  # exact for a power-of-two scale
            grad_pass.mul_grads_(grouped, multiplier, foreach)
            scaler.master_weights.set_factor(optimizer, multiplier)  # FP16 ones: when the step casts them
    if per_tensor is not None and not tracing_or_capturing():  # kept tensors mean nothing in a graph
        for observer in scaler._watchers():  # a norm is non-finite exactly when its gradient is
            observer.on_norms(scaler, optimizer, with_grad, per_tensor)
    state["found_inf_per_device"] = {device: found}
    state["stage"] = OptState.UNSCALED
    return norm


def apply_deferred_unscale(scaler: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Divide by the divisor `clip_grad_norm_` left for a fused kernel, now (one write pass):
    for a caller that reads or clips the gradients again before `step()`."""
    grad_scale = state.pop("grad_scale", None)
    if grad_scale is not None:
        scaler.master_weights.materialise(optimizer)
        with torch.no_grad():
            # an overflowing step's gradients are unscaled, not clipped (its divisor is inf or NaN)
            found = scaler._found_inf(optimizer)
            grad_scale = torch.where(found > 0, scaler._scale.to(grad_scale.device), grad_scale)
            grouped = grad_pass.group_grads(optimizer, scaler.parameter_names.name)
            grad_pass.mul_grads_(grouped, grad_scale.double().reciprocal().float(), None)
