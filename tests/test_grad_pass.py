"""The gradient pass (`hf_lossscale.core.grad_pass`) alone: grouping an optimizer's gradients,
unscaling and checking them, clamping non-finite elements."""

from __future__ import annotations

import pytest
import torch

from hf_lossscale.core.grad_pass import clamp_nonfinite_, group_grads, unscale_and_check_


def _name(param, optimizer):
    return f"p{[id(p) for g in optimizer.param_groups for p in g['params']].index(id(param))}"


def _optimizer(*grads):
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    return torch.optim.SGD(params, lr=1.0), params


def test_unscale_and_check_sets_each_devices_flag_once_and_unscales_every_dtype():
    """Gradients of two dtypes on one device share one flag, made once; an inf in either sets it;
    clean gradients come back divided by the scale. Bug caught: a flag made per dtype (the second
    overwrites the first's overflow), or a dtype group left scaled."""
    opt, params = _optimizer(torch.full((3,), 8.0), torch.full((2,), 8.0, dtype=torch.float64))
    made = []

    def flag_for(device):
        made.append(device)
        return torch.zeros(())

    found = unscale_and_check_(group_grads(opt, _name), torch.tensor(0.25), flag_for)
    assert made == [torch.device("cpu")] and found[torch.device("cpu")].item() == 0.0
    assert [p.grad.tolist() for p in params] == [[2.0] * 3, [2.0] * 2]
    params[0].grad[1] = float("inf")  # the first group overflows, the second is clean
    found = unscale_and_check_(group_grads(opt, _name), torch.tensor(1.0), lambda d: torch.zeros(()))
    assert found[torch.device("cpu")].item() == 1.0
    assert unscale_and_check_({}, torch.tensor(1.0), flag_for) == {}


def test_group_grads_refuses_half_and_bfloat16_parameters_by_name():
    """FP16 parameters are refused (unless `allow_fp16`) and BF16 ones always, each error naming
    them and the way out; parameters without gradients are left out. Bug caught: an FP16 parameter
    unscaled in its own precision (its update then rounds away), or an error without names."""
    opt, params = _optimizer(torch.ones(2), torch.ones(2, dtype=torch.float16), torch.ones(2))
    params[2].grad = None
    with pytest.raises(
        ValueError, match=r"1 trainable parameter\(s\) are held in float16: p1\. .*master_weights"
    ):
        group_grads(opt, _name)
    grouped = group_grads(opt, _name, allow_fp16=True)
    assert {dtype: len(grads) for dtype, grads in grouped[torch.device("cpu")].items()} == {
        torch.float32: 1,
        torch.float16: 1,
    }
    opt, _ = _optimizer(torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"bfloat16: p0, under an FP16 loss scaler.*bf16=True"):
        group_grads(opt, _name, allow_fp16=True)


def test_clamp_nonfinite_keeps_finite_values_and_bounds_the_rest():
    """NaN becomes 0, +-inf +-limit, finite values stay; sparse gradients through their values.
    Bug caught: a clamp that also clips finite values above the limit."""
    opt, params = _optimizer(torch.tensor([float("nan"), float("inf"), -float("inf"), 1e6]))
    clamp_nonfinite_(opt, 10.0)
    assert params[0].grad.tolist() == [0.0, 10.0, -10.0, 1e6]
