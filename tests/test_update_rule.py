"""The update rule alone (`hf_lossscale.core.update_rule`): its functions driven directly on a
`ScalerState`, without a scaler, a model or an optimizer, against the pure-Python reference
(`reference_rule.py`), and the host-known shortcut against the general rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_rule import ReferenceScaler, _f32

from hf_lossscale import LossScaleConfig
from hf_lossscale.core.scaler_state import ScalerState
from hf_lossscale.core.update_rule import (
    RuleConstants,
    StepOutcome,
    apply_known_rule,
    apply_rule,
    clamp_growth_tracker,
    torch_rule_applies,
)

CPU = torch.device("cpu")
K = RuleConstants.on(CPU)


def _state(config: LossScaleConfig) -> ScalerState:
    state = ScalerState(config)
    state.materialise(CPU)
    return state


def _flag(value: bool) -> torch.Tensor:
    return torch.tensor(bool(value))


def _values(state: ScalerState) -> dict:
    return state.host_values()


configs = st.builds(
    LossScaleConfig,
    mode=st.sampled_from(["dynamic", "dynamic", "static"]),
    init_scale=st.sampled_from([1.0, 2.0**4, 2.0**10]),
    growth_factor=st.sampled_from([2.0, 4.0, 1.5]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.75]),
    growth_interval=st.integers(1, 4),
    min_scale=st.just(1.0),
    max_scale=st.sampled_from([2.0**12, 2.0**20]),
    hysteresis=st.integers(1, 3),
    consecutive_hysteresis=st.booleans(),
    backoff_on_nonfinite_loss=st.booleans(),
)
# (skipped, loss non-finite): a non-finite loss poisons its gradients, so it comes with a skip
steps = st.lists(st.sampled_from([(False, False), (True, False), (True, True)]), min_size=1, max_size=30)


@settings(max_examples=120, deadline=None)
@given(config=configs, flags=steps)
def test_apply_rule_follows_the_reference(config, flags):
    """`apply_rule` alone, step after step, gives the reference's scale, trackers and counters, and
    says whether the loss was non-finite. Bug caught: a rule that grows on a skipped step, counts a
    forward overflow against the scale, or forgets to refill the hysteresis budget."""
    state, ref = _state(config), ReferenceScaler(config)
    for skipped, loss_bad in flags:
        result = apply_rule(config, state, K, _flag(skipped), _flag(loss_bad))
        ref.update(skipped, loss_bad)
        v = _values(state)
        assert v["scale"] == _f32(ref.scale)
        assert (v["total_steps"], v["skipped_steps"], v["consecutive_skips"]) == (
            ref.total_steps, ref.skipped_steps, ref.consecutive_skips,
        )  # fmt: skip
        assert (v["nonfinite_loss_steps"], v["consecutive_nonfinite_loss"]) == (
            ref.nonfinite_loss_steps, ref.consecutive_nonfinite_loss,
        )  # fmt: skip
        if config.mode == "dynamic":
            assert (v["_growth_tracker"], v["_hysteresis_tracker"]) == (
                ref.growth_tracker,
                ref.hysteresis_tracker,
            )
        assert v["last_step_skipped"] is skipped
        assert bool(result.loss_nonfinite) is loss_bad


@pytest.mark.parametrize(
    "hysteresis, growth_factor", [(1, 2.0), (1, 1.5), (2, 2.0)], ids=["torch", "odd", "hyst"]
)
def test_a_skipped_step_never_grows_the_scale(hysteresis, growth_factor):
    """With a growth interval of 1 a clean step grows the scale; a skipped one right after a clean
    streak must not, on torch's kernel and on the general rule. Bug caught: the streak advanced
    before the overflow is looked at (growth on the very step that overflowed)."""
    config = LossScaleConfig(
        init_scale=16.0, growth_interval=1, hysteresis=hysteresis, growth_factor=growth_factor
    )
    state = _state(config)
    apply_rule(config, state, K, _flag(False))
    assert _values(state)["scale"] == _f32(16.0 * growth_factor)
    before = _values(state)["scale"]
    result = apply_rule(config, state, K, _flag(True))
    after = _values(state)
    assert after["scale"] <= before and after["_growth_tracker"] == 0
    assert bool(StepOutcome(state).skipped) is True
    backed_off = result.backed_off if result.backed_off.dtype == torch.bool else result.backed_off > 0
    assert bool(backed_off) is (hysteresis == 1)


@pytest.mark.parametrize("backoff", [False, True])
def test_a_forward_overflow_leaves_the_scale_unless_asked(backoff):
    """A skip whose loss was non-finite is counted (skipped, non-finite) but leaves the scale and the
    growth streak, unless `backoff_on_nonfinite_loss`. Bug caught: the streak reset by a forward
    overflow (the scale would then never grow under rare loss spikes)."""
    config = LossScaleConfig(init_scale=64.0, growth_interval=3, backoff_on_nonfinite_loss=backoff)
    state = _state(config)
    apply_rule(config, state, K, _flag(False))  # a streak of one
    apply_rule(config, state, K, _flag(True), _flag(True))
    v = _values(state)
    assert (v["skipped_steps"], v["nonfinite_loss_steps"]) == (1, 1)
    assert (v["scale"], v["_growth_tracker"]) == ((32.0, 0) if backoff else (64.0, 1))


# (skipped, probe): no loss seen, a finite loss (the probe is 0), a non-finite one (NaN: its poisoned
# gradients make the step skip, so there is no clean step with it)
KNOWN_CASES = [(False, None), (False, 0.0), (True, None), (True, 0.0), (True, float("nan"))]


@pytest.mark.parametrize("mode", ["dynamic", "static"])
@pytest.mark.parametrize("backoff", [False, True])
@pytest.mark.parametrize("skipped, probe", KNOWN_CASES)
def test_the_known_rule_equals_the_general_rule(mode, backoff, skipped, probe):
    """`apply_known_rule` (the host read the skip; constants stand in for the flags) moves a state
    exactly as `apply_rule` given the same facts as device flags, from a state with counters and a
    streak under way, and decides the same backoff. Bug caught: a constant row of the counters'
    factors off by one (a clean step counted as skipped, a streak not ended)."""
    config = LossScaleConfig(
        mode=mode, init_scale=2.0**10, growth_interval=2, backoff_on_nonfinite_loss=backoff
    )
    assert torch_rule_applies(config)
    general, known = _state(config), _state(config)
    for state in (general, known):  # skipped twice (once on a non-finite loss), then one clean step
        apply_rule(config, state, K, _flag(True), _flag(False))
        apply_rule(config, state, K, _flag(True), _flag(True))
        apply_rule(config, state, K, _flag(False), _flag(False))
    probe_t = None if probe is None else torch.tensor(probe)
    loss_bad = None if probe_t is None else probe_t.ne(0) & _flag(skipped)
    a = apply_rule(config, general, K, _flag(skipped), loss_bad)
    b = apply_known_rule(config, known, K, skipped, probe_t)
    assert _values(known) == _values(general)
    assert (a.loss_nonfinite is None) == (b.loss_nonfinite is None)
    if a.loss_nonfinite is not None:
        assert bool(a.loss_nonfinite) == bool(b.loss_nonfinite)
    outcome_a, outcome_b = StepOutcome(general), StepOutcome(known)
    outcome_a.record(a)
    outcome_b.record(b)
    assert (outcome_a.backed_off is None) == (outcome_b.backed_off is None) == (mode == "static")
    if mode == "dynamic":
        assert bool(outcome_a.backed_off) == bool(outcome_b.backed_off)


def test_torch_rule_applies_only_where_its_kernel_is_exact():
    """Bug caught: torch's kernel used with hysteresis (it has no budget), a factor it rounds
    differently, or a ceiling whose growth overflows FP32."""
    assert torch_rule_applies(LossScaleConfig())
    assert not torch_rule_applies(LossScaleConfig(hysteresis=2))
    assert not torch_rule_applies(LossScaleConfig(growth_factor=3.0))
    assert not torch_rule_applies(LossScaleConfig(backoff_factor=0.3))
    assert not torch_rule_applies(LossScaleConfig(max_scale=3e38, init_scale=1.0))


def test_the_growth_tracker_is_clamped_below_the_interval_on_host_and_device():
    """Bug caught: a streak at a lowered interval left as is, which torch's kernel (growth only when
    the streak equals the interval) would then never grow."""
    config = LossScaleConfig(growth_interval=3)
    for materialise in (False, True):
        state = ScalerState(LossScaleConfig(growth_interval=10))
        if materialise:
            state.materialise(CPU)
        state.set("_growth_tracker", 7)
        clamp_growth_tracker(config, state)
        assert state.value("_growth_tracker") == 2


def test_the_outcome_reads_the_state_and_converts_a_backoff_flag_on_request():
    """`StepOutcome`: the skip flag from the state (host values before materialising, a fresh device
    tensor per update after), the backoff a float flag until asked. Bug caught: an outcome that keeps
    the previous update's skip tensor, or hands out the kernel's float flag."""
    config = LossScaleConfig()
    state = ScalerState(config)
    outcome = StepOutcome(state)
    assert outcome.skipped is False and outcome.skipped_tensor is None and outcome.backed_off is None
    state.materialise(CPU)
    outcome.record(apply_rule(config, state, K, _flag(True)))
    first = outcome.skipped_tensor
    assert outcome.backed_off.dtype == torch.bool and bool(outcome.backed_off)
    outcome.record(apply_rule(config, state, K, _flag(False)))
    assert bool(first) is True and outcome.skipped is False and bool(outcome.skipped_tensor) is False
    assert not bool(outcome.backed_off) and outcome.loss_nonfinite is None
