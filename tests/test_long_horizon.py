"""Long horizon: the device-side state stays exact over many updates (CI: 2e4; `-m slow`: 1e6):
counters exact, no drift, the scale exactly `init * 2**k` with power-of-two factors, and counters
started near 2**31 pass it without wrapping."""

import random

import pytest
import torch
from reference_rule import ReferenceScaler

from hf_lossscale import DynamicLossScaler, LossScaleConfig


def overflow_pattern(n, seed):
    """Bursts and long clean stretches: 1 step in 200 starts a burst of 1-4 overflows."""
    rng = random.Random(seed)
    out, burst = [], 0
    for _ in range(n):
        if burst == 0 and rng.random() < 1 / 200:
            burst = rng.randint(1, 4)
        out.append(burst > 0)
        burst = max(burst - 1, 0)
    return out


class Training:
    """Drives a scaler through its public protocol, as a training loop does: the gradient of one
    parameter is finite or inf, then `step(optimizer)` (skipped on inf) and `update()`."""

    def __init__(self, scaler):
        self.scaler = scaler
        self.param = torch.nn.Parameter(torch.zeros(1))
        self.optimizer = torch.optim.SGD([self.param], lr=0.0)
        self.grads = (torch.zeros(1), torch.full((1,), float("inf")))
        scaler.scale(torch.zeros(()))  # as the first scaled loss: puts the state on the device

    def __call__(self, overflow):
        self.param.grad = self.grads[overflow].clone()
        self.scaler.step(self.optimizer)
        self.scaler.update()


def run(n, config, seed=0):
    scaler = DynamicLossScaler(config)
    step = Training(scaler)
    reference = ReferenceScaler(config)
    for i, overflow in enumerate(overflow_pattern(n, seed)):
        step(overflow)
        reference.update(overflow)
        if i % 997 == 0:  # spot checks along the way
            assert scaler.get_scale() == reference.scale
    return scaler, reference


@pytest.mark.parametrize(
    "config",
    [
        LossScaleConfig(growth_interval=50, hysteresis=2, min_scale=2.0**4, max_scale=2.0**20),
        LossScaleConfig(
            growth_interval=1, hysteresis=1, consecutive_hysteresis=True, max_consecutive_skips=None
        ),
        LossScaleConfig(mode="static", init_scale=2.0**10),
    ],
    ids=["dynamic", "grow-every-step", "static"],
)
@pytest.mark.parametrize(
    "n", [pytest.param(20_000, id="2e4"), pytest.param(1_000_000, id="1e6", marks=pytest.mark.slow)]
)
def test_state_stays_exact(config, n):
    scaler, reference = run(n, config)
    stats = scaler.stats()
    assert stats["total_steps"] == n == reference.total_steps
    assert stats["skipped_steps"] == reference.skipped_steps > 0
    assert stats["consecutive_skips"] == reference.consecutive_skips
    assert stats["loss_scale"] == reference.scale
    exponent = torch.log2(torch.tensor(stats["loss_scale"] / config.init_scale, dtype=torch.float64)).item()
    assert exponent == int(exponent)  # init * 2**k exactly, no drift
    if config.mode == "dynamic":
        assert 0 <= stats["growth_tracker"] < config.growth_interval
        assert stats["growth_tracker"] == reference.growth_tracker
        assert 0 <= stats["hysteresis_tracker"] <= config.hysteresis


def test_counters_pass_2_to_the_31_without_wrapping():
    near = 2**31 - 5
    scaler = DynamicLossScaler(growth_interval=2**31 - 1, max_consecutive_skips=None, max_scale=2.0**20)
    state = scaler.state_dict()
    state.update(total_steps=near, skipped_steps=near, _growth_tracker=2**31 - 8)
    scaler.load_state_dict(state)
    step = Training(scaler)
    for _ in range(10):  # the int32 growth tracker reaches 2**31 - 1 = the interval, grows, restarts
        step(False)
    stats = scaler.stats()
    assert stats["total_steps"] == near + 10 and stats["growth_tracker"] == 3
    assert stats["loss_scale"] == 2.0**17
    for _ in range(10):
        step(True)
    stats = scaler.stats()
    assert stats["total_steps"] == near + 20 and stats["skipped_steps"] == near + 10
    assert stats["consecutive_skips"] == 10 and stats["loss_scale"] == 2.0**7
