"""Every config the validator accepts gives a correct run, at the edges of the accepted domain: scales
from FP32's smallest normal number to its largest, intervals and hysteresis up to 2**31 - 1, factors
from barely above 1 to 1e30. Checked step by step against the pure-Python reference rule, with a
clean gradient of 1.0 that must unscale to exactly 1.0 and an injected inf that must be skipped.
Loaded states and `update(new_scale=...)` get the same bounds (issue 30)."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_rule import ReferenceScaler

from hf_lossscale import DynamicLossScaler, LossScaleConfig
from hf_lossscale.core.config import INT32_MAX, INT64_MAX, SCALE_MAX, SCALE_MIN


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


EDGE_SCALES = [SCALE_MIN, 2.0**-100, 1.0, 3.0, 2.0**24, 2.0**100, f32(SCALE_MAX), SCALE_MAX]
scales = st.one_of(st.sampled_from(EDGE_SCALES), st.floats(SCALE_MIN, SCALE_MAX).map(f32))


@st.composite
def configs(draw):
    a, b, c = sorted(draw(st.lists(scales, min_size=3, max_size=3)))
    return LossScaleConfig(
        min_scale=a,
        init_scale=b,
        max_scale=c,
        growth_factor=draw(st.sampled_from([1.0000001, 2.0, 1e30])),
        backoff_factor=draw(st.sampled_from([1e-30, 0.5, 0.9999999])),
        growth_interval=draw(st.sampled_from([1, 2, 3, INT32_MAX])),
        hysteresis=draw(st.sampled_from([1, 2, INT32_MAX])),
        consecutive_hysteresis=draw(st.booleans()),
        max_consecutive_skips=draw(st.sampled_from([None, INT64_MAX])),
        telemetry_interval=0,
    )


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), overflows=st.lists(st.booleans(), min_size=1, max_size=12))
def test_accepted_domain_follows_the_reference_and_never_corrupts(config, overflows):
    """Bugs caught: the int32 growth tracker wrapping (growth on every step), a reciprocal that
    overflows (a clean gradient of 1.0 unscaled to inf and stepped), growth past FP32's largest value
    (an inf scale, every later step skipped)."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    scaler = DynamicLossScaler(config)
    reference = ReferenceScaler(config)
    for overflow in overflows:
        with torch.no_grad():
            param.fill_(5.0 if overflow else 0.0)  # from 0 a step of -g moves it by exactly g
        before = param.detach().clone()
        scaler.scale(torch.ones(()))  # the loss (finite): materialises the state on this device
        param.grad = torch.full((1,), math.inf) if overflow else scaler.state["scale"].reshape(1).clone()
        scaler.step(opt)
        scaler.update()
        reference.update(overflow)
        if overflow:
            assert torch.equal(param.detach(), before)
        else:  # a clean gradient of 1.0 after unscaling: a step of -1, to an ulp of scale * fp32(1/scale);
            # above 2**126 the reciprocal is subnormal and keeps fewer bits (as torch's GradScaler's does)
            moved = float(before - param.detach())
            assert abs(moved - 1.0) <= 2.0**-23 + 2.0**-149 * scaler.get_scale(), (moved, scaler.get_scale())
        stats = scaler.stats()
        assert math.isfinite(stats["loss_scale"]) and SCALE_MIN <= stats["loss_scale"] <= SCALE_MAX
        assert stats["loss_scale"] == f32(reference.scale), (stats, reference)
        assert (stats["growth_tracker"], stats["hysteresis_tracker"]) == (
            reference.growth_tracker,
            reference.hysteresis_tracker,
        )
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("_growth_tracker", 2**31, r"2\*\*31 - 1"),
        ("_hysteresis_tracker", 2**40, r"2\*\*31 - 1"),
        ("total_steps", 2**63, r"2\*\*63 - 1"),
        ("scale", 2.0**-130, "normal range"),
        ("scale", 1e39, "normal range"),
    ],
)
def test_loaded_state_beyond_the_device_types_is_refused_by_name(key, value, match):
    """Bug caught: a raw "value cannot be converted" at the first step instead of an error that
    names the key."""
    scaler = DynamicLossScaler()
    scaler.scale(torch.ones(()))
    state = {**scaler.state_dict(), key: value}
    with pytest.raises(ValueError, match=match) as err:
        DynamicLossScaler().load_state_dict(state)
    assert key in str(err.value)


def test_state_format_version_and_foreign_formats():
    scaler = DynamicLossScaler()
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match="format_version=99"):
        DynamicLossScaler().load_state_dict({**scaler.state_dict(), "format_version": 99})
    with pytest.raises(ValueError, match="unknown format"):
        DynamicLossScaler().load_state_dict({**scaler.state_dict(), "format": "deepspeed"})
    without = {k: v for k, v in scaler.state_dict().items() if k != "format"}
    with pytest.warns(UserWarning, match="counters are dropped"):
        DynamicLossScaler().load_state_dict(without)


@pytest.mark.parametrize("value", [0.0, 2.0**-130, math.inf, math.nan, 1e39])
def test_update_new_scale_is_checked(value):
    scaler = DynamicLossScaler()
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(new_scale=value)


def test_config_files_duplicates_yaml_strings_binary_and_numpy(tmp_path):
    """Issue 30: a key given twice (PyYAML and json keep the last silently), `init_scale: 1e4` (a
    string under YAML 1.1), a binary file, and numpy scalars. Bugs caught: a silently ignored setting,
    an error that does not say why 1e4 is not a number, a raw UnicodeDecodeError."""
    import numpy as np

    cases = {
        "dup.yaml": ("init_scale: 1024.0\ninit_scale: 2048.0\n", "'init_scale' is given twice"),
        "dup.json": ('{"init_scale": 1024, "init_scale": 2048}', "'init_scale' is given twice"),
        "exp.yaml": ("init_scale: 1e4\n", "reads exponents without a dot or sign such as 1e4 as strings"),
    }
    for name, (text, match) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=match):
            LossScaleConfig.from_file(tmp_path / name)
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00\x01binary")
    with pytest.raises(ValueError, match=r"bin\.yaml.*not UTF-8 text"):
        LossScaleConfig.from_file(tmp_path / "bin.yaml")
    config = LossScaleConfig(init_scale=np.float32(1024.0), growth_interval=np.int64(10), hysteresis=np.int32(2),
                             consecutive_hysteresis=np.bool_(True))  # fmt: skip
    assert config == LossScaleConfig(
        init_scale=1024.0, growth_interval=10, hysteresis=2, consecutive_hysteresis=True
    )
    assert type(config.growth_interval) is int and type(config.init_scale) is float
    with pytest.raises(ValueError, match="integer"):
        LossScaleConfig(growth_interval=np.bool_(True))


def test_naming_parameters_is_linear_in_tensors():
    """Issue 30: without `set_parameter_names`, naming scanned the optimizer's list for every tensor
    (69 s at 60,000 tensors). Counted, not timed: the optimizer's groups are walked once per
    optimizer, however many tensors are named. Bug caught: the scan per tensor coming back."""
    from hf_lossscale.core.scaler_observers import ParameterNames

    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2000)]
    opt = torch.optim.SGD(params, lr=0.1)
    walks = []

    class Counting(list):
        def __iter__(self):
            walks.append(1)
            return super().__iter__()

    opt.param_groups[0]["params"] = Counting(opt.param_groups[0]["params"])
    names = ParameterNames()
    assert [names.name(p, opt) for p in params[::100]][-1] == "param_groups[0].params[1900] (shape (1,))"
    assert len(walks) <= 2
