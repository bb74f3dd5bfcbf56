"""The scaler's state structure (`ScalerState`), its checkpoint format across versions, and the
observer interface the scaler calls."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import scaler_step

from hf_lossscale import DynamicLossScaler, LossScaleConfig
from hf_lossscale.core.config import FP16_FIELDS
from hf_lossscale.core.scaler_observers import ScalerObserver
from hf_lossscale.core.scaler_state import FIELDS, ScalerState

OLD_STATE = Path(__file__).parent / "data" / "scaler_state_v1.pt"


def test_checkpoint_written_before_the_state_split_loads_and_continues():
    """`tests/data/scaler_state_v1.pt` was written by the scaler as it was before `ScalerState`
    existed (commit d0451e1), with the stats of six further steps. Loading it must give back the same
    state dict, and the same overflow pattern must walk the same trajectory. Catches a renamed or
    reordered state key, a hysteresis tracker reset on load, and counters not restored."""
    saved = torch.load(OLD_STATE, weights_only=True)
    config = saved["state"]["config"]
    scaler = DynamicLossScaler(**config)
    scaler.load_state_dict(saved["state"])
    written = scaler.state_dict()
    # every key it had comes back unchanged; the config gains the fields added since, at their defaults,
    # and leaves the model's FP16 handling (FP16_FIELDS) out: it is no longer the scaler's
    assert {k: v for k, v in written.items() if k in saved["state"] and k != "config"} == {
        k: v for k, v in saved["state"].items() if k != "config"
    }
    expected = {**LossScaleConfig().to_dict(), **saved["state"]["config"]}
    assert written["config"] == {k: v for k, v in expected.items() if k not in FP16_FIELDS}
    # the keys added since load as a fresh run's
    assert {k: written[k] for k in set(written) - set(saved["state"])} == {
        "nonfinite_loss_steps": 0,
        "consecutive_nonfinite_loss": 0,
        "fp32_modules": [],
    }
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for overflow, expected in zip(saved["next_overflows"], saved["stats_after"], strict=True):
        scaler_step(scaler, model, opt, grad_inf=bool(overflow))
        stats = scaler.stats()
        assert {k: stats[k] for k in expected} == expected
        assert stats["nonfinite_loss_steps"] == 0  # its overflows are in the gradients, the loss is finite


def test_state_fields_are_spelled_once():
    """Materialising, reading back and the state dict all follow `FIELDS`: a field added there
    reaches every one of them (catches a field missing from `host_values` or `state_dict`)."""
    from hf_lossscale import LossScaleConfig

    state = ScalerState(LossScaleConfig(init_scale=8.0, hysteresis=3))
    assert list(state.host) == list(FIELDS)
    state.materialise(torch.device("cpu"))
    assert {k: t.dtype for k, t in state.tensors.items()} == FIELDS
    state["total_steps"].add_(5)
    values = state.host_values()
    assert values == {**ScalerState.initial(LossScaleConfig(init_scale=8.0, hysteresis=3)), "total_steps": 5}
    assert [type(v) for v in values.values()] == [float, int, int, int, int, int, bool, int, int]
    written = state.state_dict(LossScaleConfig(init_scale=8.0, hysteresis=3))
    assert set(FIELDS) <= set(written)


class Recorder(ScalerObserver):
    def __init__(self):
        self.calls = []

    def before_unscale(self, scaler, optimizer):
        self.calls.append(("before_unscale", scaler.iteration))

    def on_norms(self, scaler, optimizer, params, nonfinite):
        self.calls.append(("on_norms", len(params)))

    def before_step(self, scaler, optimizer, skipped):
        self.calls.append(("before_step", skipped))

    def on_update(self, scaler, rule_applied):
        self.calls.append(("on_update", rule_applied))

    def on_state_loaded(self, scaler):
        self.calls.append(("on_state_loaded",))


def test_observer_is_called_at_fixed_points():
    """The order and arguments of the observer calls over plain, fused, clipped and hand-set
    iterations. Catches a hook that is skipped on one path (e.g. `update(new_scale)` not telling
    the observers, or the fused path claiming to know the skip on the host)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    plain = torch.optim.SGD(model.parameters(), lr=0.01)
    fused = torch.optim.AdamW(model.parameters(), fused=True)
    scaler = DynamicLossScaler(init_scale=2.0**4)
    rec = Recorder()
    scaler.observers.append(rec)
    scaler_step(scaler, model, plain, grad_inf=True)
    scaler_step(scaler, model, fused, grad_inf=False)
    loss = model(torch.randn(3, 4)).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.clip_grad_norm_(plain, 1.0)
    scaler.step(plain)
    scaler.update(new_scale=8.0)
    scaler.load_state_dict(scaler.state_dict())
    assert rec.calls == [
        ("before_unscale", 0), ("before_step", True), ("on_update", True),
        ("before_unscale", 1), ("before_step", None), ("on_update", True),
        ("before_unscale", 2), ("on_norms", 2), ("before_step", False), ("on_update", False),
        ("on_state_loaded",),
    ]  # fmt: skip


def test_emptying_the_observers_keeps_names_and_the_collapse_check():
    """`observers` holds only the optional observers (telemetry): with it emptied, overflowing
    parameters are still named and the collapse check still raises at `max_consecutive_skips`.
    Bug caught: the collapse check living in the user-editable list, so `observers.clear()` (to drop
    telemetry) silently lets a run skip every step forever."""
    from hf_lossscale import LossScaleCollapseError

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = DynamicLossScaler(init_scale=2.0**4, max_consecutive_skips=3, min_scale=1.0)
    scaler.set_parameter_names(model)
    scaler.observers.clear()
    scaler_step(scaler, model, opt, grad_inf=True)
    assert scaler.overflow_params  # named without any observer in the list
    scaler_step(scaler, model, opt, grad_inf=True)
    with pytest.raises(LossScaleCollapseError):
        scaler_step(scaler, model, opt, grad_inf=True)


def test_off_mode_has_no_observers():
    off = DynamicLossScaler(mode="off")
    assert off.observers == [] and off.skip_watch is None
    from hf_lossscale.core.scaler_observers import SkipWatch, TelemetryWatch

    on = DynamicLossScaler()
    assert isinstance(on.skip_watch, SkipWatch) and [type(o) for o in on.observers] == [TelemetryWatch]


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_collapse_still_raised_through_the_observer(mode):
    from hf_lossscale import LossScaleCollapseError

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = DynamicLossScaler(mode=mode, init_scale=2.0**4, max_consecutive_skips=3)
    scaler.set_parameter_names(model)
    scaler_step(scaler, model, opt, grad_inf=True)
    scaler_step(scaler, model, opt, grad_inf=True)
    with pytest.raises(LossScaleCollapseError, match=r"3 optimizer steps in a row.*weight"):
        scaler_step(scaler, model, opt, grad_inf=True)


PATTERN = [  # (loss NaN, gradient inf): clean, backward overflows, forward overflows, growth after a streak
    (False, False), (False, True), (False, False), (True, False), (True, False), (False, False),
    (False, True), (True, True), (False, False), (False, False), (False, False), (False, False),
]  # fmt: skip


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
)  # CUDA: the bool factors and the comparison written to a float flag go through its kernels
@pytest.mark.parametrize(
    "config",
    [
        dict(growth_interval=2),
        dict(growth_interval=2, hysteresis=2),
        dict(growth_interval=2, backoff_on_nonfinite_loss=True),
        dict(mode="static"),
    ],
    ids=["default", "hysteresis", "backoff_on_nonfinite_loss", "static"],
)
def test_host_known_and_device_decided_steps_move_the_state_alike(config, device):
    """A non-fused optimizer's step reads the overflow flag on the host, and `update()` then runs the
    rule's clean or skip branch from constants; a fused one's step decides on the device and `update()` reads
    the flags there. Over clean steps, backward and forward overflows and growths, the two paths
    must leave identical states after every update, and the same flags (the loss non-finite, the
    scale backed off). Bugs caught: a wrong constant in the clean or the skip branch (a streak not
    ended, a step not counted, a non-finite loss not counted, the growth tracker not advanced or
    not kept over a forward overflow), the clean branch taken after a non-finite loss, a forward
    overflow backing off (or, with backoff_on_nonfinite_loss, not), or a fast path the hysteresis
    config should not take."""
    states = {}
    for kind in ("sgd", "adamw_fused"):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2).to(device)
        opt = (
            torch.optim.SGD(model.parameters(), lr=0.0)
            if kind == "sgd"
            else torch.optim.AdamW(model.parameters(), lr=0.0, fused=True)
        )
        scaler = DynamicLossScaler(init_scale=2.0**8, max_consecutive_skips=None, **config)
        states[kind] = []
        for loss_nan, grad_inf in PATTERN:
            scaler_step(scaler, model, opt, loss_nan=loss_nan, grad_inf=grad_inf, device=device)
            flags = [scaler.last_loss_nonfinite, scaler.last_backed_off]
            states[kind].append((scaler.state.host_values(), [None if f is None else bool(f) for f in flags]))
    assert states["sgd"] == states["adamw_fused"]
    if config.get("mode") == "static":
        return
    # [loss non-finite, backed off] at a clean step, a backward overflow, a clean step, a forward overflow
    backward = config.get("hysteresis", 1) == 1  # with a budget of two, the first overflow is absorbed
    forward = bool(config.get("backoff_on_nonfinite_loss"))
    expected = [[False, False], [False, backward], [False, False], [True, forward]]
    assert [f for _, f in states["sgd"][:4]] == expected
    last = states["sgd"][-1][0]
    assert (
        last["total_steps"] == len(PATTERN)
        and last["skipped_steps"] == 5
        and last["nonfinite_loss_steps"] == 3
    )
    assert last["consecutive_skips"] == 0
    if not forward:
        assert last["scale"] > 2.0**6  # it grew again after the skips


def test_a_clean_run_copies_only_the_counters_to_the_host(monkeypatch):
    """Per update the skip watch copies the five counters (one copy); the scale goes to the host for
    the floor event only while it may sit at the floor: at the first update, and while the host's
    lower bound (the last scale read, halved per skip since) reaches `min_scale`. Bugs caught: the
    scale copied at every update (a device op each step) or after every skip, a bound that ignores a
    skip (the floor reached unseen: no floor event), or the floor watch never looking again."""
    from hf_lossscale.core import scaler_observers

    copies = []

    class Recording(scaler_observers.HostCopy):
        def __init__(self, tensor):
            kind = "scale" if tensor.dim() == 0 else "counters" if tensor.dtype == torch.int64 else "names"
            copies.append(kind)
            super().__init__(tensor)

    monkeypatch.setattr(scaler_observers, "HostCopy", Recording)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, fused=True)
    scaler = DynamicLossScaler(init_scale=8.0, min_scale=1.0, floor_event_steps=3, max_consecutive_skips=None)

    def steps(n, **kw):
        copies.clear()
        for _ in range(n):
            scaler_step(scaler, model, opt, **kw)
        return list(copies)

    assert steps(1) == ["counters", "scale"]  # the first update looks once: 8
    assert steps(10) == ["counters"] * 10
    # two skips (8 -> 4 -> 2): the bound (8 / 2, then 8 / 4) stays above the floor: no scale copy
    assert steps(1, grad_inf=True) == ["counters"]
    assert steps(1, grad_inf=True) == ["names", "counters"]  # the step after a skip names
    assert steps(3) == ["names", "counters", "counters", "counters"]
    with pytest.warns(UserWarning, match="sat at its floor"):
        # the third skip (2 -> 1) brings the bound to the floor: every update looks until the event
        skipped = steps(1, grad_inf=True)
        at_floor = steps(3)
    assert skipped.count("scale") == 1 and at_floor.count("scale") == 3
    assert [e["event"] for e in scaler.drain_events()] == ["floor"]
    # update(new_scale) makes the scale unknown: the next update looks once, then the bound holds
    scaler.update(new_scale=64.0)
    assert steps(2) == ["counters", "scale", "counters"]


def test_the_floor_event_with_copies_that_land_late(monkeypatch):
    """On CUDA a host copy lands an update or so after it was made. Simulated: every copy is ready
    only at the update after the next. The floor is still seen (the bound counts each update whose
    counters are not read yet as a possible skip), the event fires once, and a run far above the
    floor copies only the counters. Bugs caught: a bound that trusts a stale skip count (a floor
    reached between two reads goes unseen), or one that never relaxes (the scale copied at every
    update for good)."""
    from hf_lossscale.core import scaler_observers

    updates = [0]
    copies = []

    class Late(scaler_observers.HostCopy):
        def __init__(self, tensor):
            super().__init__(tensor)
            self.lands = updates[0] + 2
            copies.append("scale" if tensor.dim() == 0 else "other")

        def ready(self):
            return updates[0] >= self.lands

    monkeypatch.setattr(scaler_observers, "HostCopy", Late)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, fused=True)
    scaler = DynamicLossScaler(
        init_scale=2.0**10, min_scale=1.0, floor_event_steps=4, max_consecutive_skips=None
    )

    def step(**kw):
        scaler_step(scaler, model, opt, **kw)
        updates[0] += 1

    for _ in range(20):  # far above the floor: after the first looks, only the counters
        step()
    copies.clear()
    for _ in range(10):
        step()
    assert "scale" not in copies
    with pytest.warns(UserWarning, match="sat at its floor"):
        for _ in range(10):  # 2^10 -> 1 in ten skips
            step(grad_inf=True)
        for _ in range(6):
            step()
    assert [e["event"] for e in scaler.drain_events()] == ["floor"]
    # at the floor from the tenth skip on: 7 updates, of which the last two copies are in flight
    assert scaler.skip_watch.steps_at_floor == 5


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_every_loss_of_an_iteration_joins_the_probe(kind):
    """Gradient accumulation: two `scale()` calls per iteration, one loss non-finite (an inf added
    to it: the gradients stay finite), first or second. The probe sits in the flags buffer and the
    second loss is added in place: either way the step is skipped as a forward overflow (counted,
    the scale kept), and two finite losses make a clean step. With a 3-element loss (outside the
    buffer) the same. Bugs caught: the second loss overwriting the first's probe instead of adding
    to it, an in-place add that drops a non-finite loss, or the buffer read at update() after a
    probe that is not in it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.0)
        if kind == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=0.0, fused=True)
    )
    scaler = DynamicLossScaler(init_scale=2.0**8, max_consecutive_skips=None)
    inf = torch.tensor(float("inf"))
    seen = []
    for bad, shape in [(None, ()), (0, ()), (1, ()), (None, ()), (1, (3,)), (None, (3,))]:
        for micro in range(2):
            loss = model(torch.randn(3, 4)).pow(2).mean(dim=1 if shape else (0, 1))
            if micro == bad:
                loss = loss + inf
            scaler.scale(loss).backward(torch.ones_like(loss) if shape else None)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        seen.append((bool(scaler.last_loss_nonfinite), scaler.get_scale()))
    assert seen == [
        (False, 256.0),
        (True, 256.0),
        (True, 256.0),
        (False, 256.0),
        (True, 256.0),
        (False, 256.0),
    ]
    counters = scaler.state.host_values()
    assert counters["skipped_steps"] == 3 and counters["nonfinite_loss_steps"] == 3


def test_the_model_fp16_handling_neither_travels_in_the_checkpoint_nor_warns_on_resume(recwarn):
    """A checkpoint carries the scaler's config, not `FP16_FIELDS`; resuming with other FP16 settings
    says nothing, and a checkpoint written before the split (its config holding those fields, with
    other values) loads silently too; a rule field that differs is still named. Bug caught: a resume
    that changes master_weights or fp32_modules warning "different config" on every start."""
    from hf_lossscale.core.config import FP16_FIELDS

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = DynamicLossScaler(master_weights=True, fp32_modules="auto", fp16_on_cpu="native")
    scaler_step(scaler, model, opt)
    state = scaler.state_dict()
    assert not set(FP16_FIELDS) & set(state["config"])
    old = {**state, "config": {**state["config"], **LossScaleConfig(master_weights=True, fp32_modules="x",
                                                                     max_auto_fp32_modules=2).fp16.to_dict()}}  # fmt: skip
    for saved in (state, old):
        resumed = DynamicLossScaler(master_weights=False, fp32_modules=(), max_auto_fp32_modules=5)
        resumed.load_state_dict(saved)
        assert resumed.stats() == scaler.stats() and resumed.config.master_weights is False
    assert [str(w.message) for w in recwarn] == []
    with pytest.warns(UserWarning, match=r"different config.*\['hysteresis'\]"):
        DynamicLossScaler(hysteresis=3).load_state_dict(old)


def test_counts_read_the_scalers_counters():
    """`counts()` gives the counters `stats()` gives, plus the applied steps, on the host before the
    first step too. Bug caught: a count kept apart from the scaler's counters drifting from them."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    assert scaler.counts() == (0, 0, 0, 0, 0)
    for grad_inf in (False, True, True, False):
        scaler_step(scaler, model, opt, grad_inf=grad_inf)
    counts, stats = scaler.counts(), scaler.stats()
    assert counts._asdict() == {k: stats[k] for k in counts._fields}
    assert (counts.total_steps, counts.skipped_steps, counts.applied_steps) == (4, 2, 2)
