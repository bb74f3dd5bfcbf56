"""Fault injection: random inf / -inf / NaN patterns (in one gradient or many, in the loss, in any
micro-batch of an accumulation window, in one of several optimizers; dynamic and static modes,
hysteresis > 1; SGD, AdamW foreach and fused) never touch a skipped optimizer's parameters or
state; every optimizer step that is not skipped is bitwise the unscaled FP32 control's (FP32
model, power-of-two scales); counters and scale follow the pure-Python reference rule.

CI runs `CI_EXAMPLES` cases; `pytest -m slow -s tests/test_fault_injection.py` runs
`FULL_EXAMPLES` and prints how many fault patterns were tried.
"""

import copy
import math
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_rule import ReferenceScaler

from hf_lossscale import DynamicLossScaler, LossScaleConfig

CI_EXAMPLES = 200
FULL_EXAMPLES = 1200
N_PARAMS = 4  # two Linear layers: weight, bias, weight, bias
TALLY: Counter = Counter()


@dataclass(frozen=True)
class Fault:
    micro: int  # which micro-batch of the accumulation window
    where: str  # "loss" or "grads"
    value: float  # inf, -inf or nan
    params: tuple[int, ...]  # which parameter tensors (for "grads")
    elements: int  # how many elements of each (for "grads")


@st.composite
def cases(draw):
    accumulation = draw(st.integers(1, 3))
    fault = st.builds(
        Fault,
        micro=st.integers(0, accumulation - 1),
        where=st.sampled_from(["loss", "grads"]),
        value=st.sampled_from([math.inf, -math.inf, math.nan]),
        params=st.lists(st.integers(0, N_PARAMS - 1), min_size=1, max_size=N_PARAMS, unique=True).map(tuple),
        elements=st.integers(1, 3),
    )
    return {
        "mode": draw(st.sampled_from(["dynamic", "static"])),
        "backoff_on_nonfinite_loss": draw(st.booleans()),
        "hysteresis": draw(st.integers(1, 3)),
        "init_exp": draw(st.integers(0, 20)),
        "growth_interval": draw(st.integers(1, 3)),
        "optimizer": draw(st.sampled_from(["sgd", "adamw", "adamw_fused"])),
        "n_optimizers": draw(st.integers(1, 2)),
        "accumulation": accumulation,
        "steps": draw(st.lists(st.one_of(st.none(), fault), min_size=1, max_size=6)),
        "seed": draw(st.integers(0, 2**16)),
    }


def make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, foreach=kind == "adamw", fused=kind == "adamw_fused")


def state_snapshot(opt):
    return copy.deepcopy(opt.state_dict()["state"])


def _fresh(entry):
    """A state entry that equals no state at all: a fused optimizer materialises zero moments and
    step 0 on a skipped first step (torch does the same under its GradScaler)."""
    return all((not torch.is_tensor(v)) or not v.any() for v in entry.values())


def states_equal(after, before):
    for key in after.keys() - before.keys():
        if not _fresh(after[key]):
            return False
    for key in before:
        if key not in after or after[key].keys() != before[key].keys():
            return False
        for name in before[key]:
            x, y = after[key][name], before[key][name]
            if not (torch.equal(x, y) if torch.is_tensor(x) else x == y):
                return False
    return True


def run_case(case):
    torch.manual_seed(case["seed"])
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    control = copy.deepcopy(model)
    params, control_params = list(model.parameters()), list(control.parameters())
    split = [[0, 1], [2, 3]] if case["n_optimizers"] == 2 else [[0, 1, 2, 3]]
    opts = [make_optimizer(case["optimizer"], [params[i] for i in g]) for g in split]
    control_opts = [make_optimizer(case["optimizer"], [control_params[i] for i in g]) for g in split]
    owner = {i: k for k, g in enumerate(split) for i in g}
    config = LossScaleConfig(
        mode=case["mode"],
        init_scale=2.0 ** case["init_exp"],
        hysteresis=case["hysteresis"],
        growth_interval=case["growth_interval"],
        max_consecutive_skips=None,
        backoff_on_nonfinite_loss=case["backoff_on_nonfinite_loss"],
    )
    scaler = DynamicLossScaler(config)
    reference = ReferenceScaler(config)
    acc = case["accumulation"]

    for step, fault in enumerate(case["steps"]):
        data = [(torch.randn(3, 4), torch.randn(3, 2)) for _ in range(acc)]
        before = [[p.detach().clone() for p in g] for g in ([params[i] for i in s] for s in split)]
        before_state = [state_snapshot(o) for o in opts]
        for micro, (x, y) in enumerate(data):
            loss = torch.nn.functional.mse_loss(model(x), y) / acc
            if fault is not None and fault.where == "loss" and fault.micro == micro:
                loss = loss * fault.value
            scaler.scale(loss).backward()
            if fault is not None and fault.where == "grads" and fault.micro == micro:
                for i in fault.params:
                    params[i].grad.view(-1)[: fault.elements] = fault.value
            torch.nn.functional.mse_loss(control(x), y).div(acc).backward()
        faulty = set()
        if fault is not None:
            faulty = set(range(len(opts))) if fault.where == "loss" else {owner[i] for i in fault.params}
        for k, opt in enumerate(opts):
            scaler.step(opt)
            if k not in faulty:
                control_opts[k].step()
        scaler.update()
        reference.update(bool(faulty), loss_nonfinite=fault is not None and fault.where == "loss")
        TALLY["steps"] += 1
        if fault is not None:
            TALLY["faults"] += 1
            TALLY[f"{fault.where} {fault.value} micro {fault.micro}/{acc}"] += 1
            TALLY[f"{len(faulty)} of {len(opts)} optimizers skipped"] += 1

        for k, group in enumerate(split):
            if k in faulty:  # skipped: nothing moved
                assert all(torch.equal(params[i], b) for i, b in zip(group, before[k], strict=True)), (
                    step,
                    k,
                )
                assert states_equal(state_snapshot(opts[k]), before_state[k]), (step, k)
            else:  # stepped: bitwise the unscaled FP32 control
                assert all(torch.equal(params[i], control_params[i]) for i in group), (step, k)
        stats = scaler.stats()
        expected = {
            "loss_scale": reference.scale,
            "total_steps": reference.total_steps,
            "skipped_steps": reference.skipped_steps,
            "consecutive_skips": reference.consecutive_skips,
            "nonfinite_loss_steps": reference.nonfinite_loss_steps,
            "consecutive_nonfinite_loss": reference.consecutive_nonfinite_loss,
        }
        assert {k: stats[k] for k in expected} == expected, (step, stats, expected)
        if case["mode"] == "dynamic":
            assert stats["growth_tracker"] == reference.growth_tracker
            assert stats["hysteresis_tracker"] == reference.hysteresis_tracker
        for opt in (*opts, *control_opts):
            opt.zero_grad(set_to_none=True)


_common = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=CI_EXAMPLES, **_common)
@given(case=cases())
def test_fault_patterns(case):
    run_case(case)


@pytest.mark.slow
@settings(max_examples=FULL_EXAMPLES, **_common)
@given(case=cases())
def test_fault_patterns_full(case):
    run_case(case)


@pytest.mark.slow
def test_fault_pattern_tally():
    """Run after the full suite (`-m slow -s`): print what was tried, and that it was enough."""
    if TALLY["steps"] == 0:
        pytest.skip("run together with test_fault_patterns_full")
    print("\nfault injection tally:")
    for key, count in sorted(TALLY.items()):
        print(f"  {key}: {count}")
    assert TALLY["faults"] >= 1000
