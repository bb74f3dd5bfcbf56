"""The one-pass master-weight Adam/AdamW kernel (issue 49, item 2) against torch's optimizer on FP32
weights: to 1 ulp. Where Triton is installed it runs here through Triton's interpreter
(`TRITON_INTERPRET=1`, on the CPU); on a GPU, `benchmarks/gpu_check.sh` runs these tests on CUDA."""

import math

import pytest
import torch

from hf_lossscale.masters import kernel as master_kernel
from hf_lossscale.masters.kernel import OnePassSlot, one_pass_reason, run_one_pass

needs_triton = pytest.mark.skipif(not master_kernel.triton_available(), reason="Triton is not installed")


@pytest.fixture
def device(monkeypatch):
    if torch.cuda.is_available():
        return "cuda"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    master_kernel._kernel.cache_clear()
    yield "cpu"
    master_kernel._kernel.cache_clear()


def _ulps(a: torch.Tensor, b: torch.Tensor, before: torch.Tensor | None = None) -> float:
    return float(_ulp_errors(a, b, before).max())


def _ulp_errors(a: torch.Tensor, b: torch.Tensor, before: torch.Tensor | None = None) -> torch.Tensor:
    """The largest difference in units of the last place of the largest of `b`, `before` (the value
    before the step) and the update `b - before`: where an update cancels most of a weight, the unit is
    that of the operands, not of what is left."""
    ref = b.abs().float()
    if before is not None:
        ref = torch.maximum(torch.maximum(ref, before.abs().float()), (b.float() - before.float()).abs())
    ulp = torch.finfo(b.dtype).eps * torch.exp2(
        torch.floor(torch.log2(ref.clamp_min(torch.finfo(b.dtype).tiny)))
    )
    return (a.float() - b.float()).abs() / ulp


def cuda_adam_math(
    param, exp_avg, exp_avg_sq, grad, step, *, lr, beta1, beta2, eps, wd, decoupled, grad_scale=None
):
    """torch's fused CUDA Adam (`adam_math`, fused_adam_utils.cuh) on the CPU, right by construction: its
    hyperparameters are doubles, its bias corrections and values FP32, so each expression mixing a
    hyperparameter in is computed in double and rounded to FP32 where it is stored."""
    f, d = (lambda x: x.float()), (lambda x: x.double())
    if grad_scale is not None:
        grad = f(d(grad) / float(grad_scale))
    if wd:
        if decoupled:
            param = f(d(param) - lr * wd * d(param))
        else:
            grad = f(d(grad) + d(param) * wd)
    exp_avg = f(beta1 * d(exp_avg) + (1 - beta1) * d(grad))
    exp_avg_sq = f(beta2 * d(exp_avg_sq) + (1 - beta2) * d(grad) * d(grad))
    # the bias corrections in double, handed to the kernel as FP32 (`const opmath_t&`)
    bias_correction1 = float(torch.tensor(1 - beta1**step, dtype=torch.float32))
    bc2_sqrt = torch.tensor((1 - beta2**step) ** 0.5, dtype=torch.float32)
    step_size = torch.tensor(lr / bias_correction1, dtype=torch.float32)
    denom = f(d(exp_avg_sq.sqrt() / bc2_sqrt) + eps)
    return param - step_size * exp_avg / denom, exp_avg, exp_avg_sq


HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.01)


def _one_step(device, decoupled, fused, step, seed, n=3000):
    """One kernel step from a random state, and torch's fused CUDA arithmetic from the same state (torch
    itself on CUDA; `cuda_adam_math` on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    master = (torch.randn(n, generator=g) * 0.1).to(device)
    exp_avg = (torch.randn(n, generator=g) * 1e-2).to(device)
    exp_avg_sq = (torch.rand(n, generator=g) * 1e-3).to(device)
    grad16 = (torch.randn(n, generator=g) * 100).half().to(device)
    factor = torch.tensor(0.25, device=device)
    grad_scale = torch.tensor(8.0, device=device) if fused else None
    before = master.clone()
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    key = torch.zeros(n, device=device, requires_grad=True)
    opt = cls([key], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
              weight_decay=HYPER["wd"], fused=fused or None, foreach=False if not fused else None)  # fmt: skip
    counter = torch.tensor(float(step - 1), device=device if fused else "cpu")
    state = {"step": counter, "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}
    weight = master.half()
    ours = master.clone()
    found_inf = torch.zeros((), device=device) if fused else None
    run_one_pass(opt, opt.param_groups[0], [OnePassSlot(key, grad16, factor, ours, weight)], lambda k: state,
                 grad_scale, found_inf)  # fmt: skip
    grad = grad16.float() * factor
    if device == "cuda":
        ref = before.clone().requires_grad_()
        torch_opt = cls([ref], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                        weight_decay=HYPER["wd"], fused=True)  # fmt: skip
        torch_opt.state[ref].update(step=torch.tensor(float(step - 1), device=device), exp_avg=exp_avg.clone(),
                                    exp_avg_sq=exp_avg_sq.clone())  # fmt: skip
        ref.grad = grad.clone()
        if fused:
            torch_opt.grad_scale, torch_opt.found_inf = grad_scale, torch.zeros((), device=device)
        torch_opt.step()
        expected = (ref.detach(), torch_opt.state[ref]["exp_avg"], torch_opt.state[ref]["exp_avg_sq"])
    else:
        expected = cuda_adam_math(before, exp_avg, exp_avg_sq, grad, step, decoupled=decoupled,
                                  grad_scale=grad_scale, **HYPER)  # fmt: skip
    return (ours, weight, state), expected, before


@needs_triton
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "host-counter"])
@pytest.mark.parametrize("step", [1, 7, 1000])
def test_the_kernel_is_torchs_fused_adam_to_one_ulp(device, monkeypatch, decoupled, fused, step):
    if not fused:  # a for-loop group's counter is on the host (on a CPU it is beside the master anyway)
        monkeypatch.setattr(master_kernel, "_counter_on_device", lambda step, master: False)
    (ours, weight, state), (param, exp_avg, exp_avg_sq), before = _one_step(
        device, decoupled, fused, step, seed=step
    )
    # the master: within 1 ulp of the operands' magnitude, 2 in a rare element (an update of the size of
    # the weight, where the double intermediates' rounding differs: 1-2 elements in 3,000 here)
    errors = _ulp_errors(ours, param, before)
    assert errors.max() <= 2 and (errors > 1).float().mean() <= 1e-3
    assert _ulps(state["exp_avg"], exp_avg) <= 1 and _ulps(state["exp_avg_sq"], exp_avg_sq) <= 1
    # the FP16 weight is the master rounded (bitwise), and the counter moved once
    assert torch.equal(weight, ours.half())
    assert float(state["step"]) == step


def _case(device, decoupled, fused, steps=1, seed=0, shapes=((37, 11), (1000,), (3, 5, 7))):
    """Parameters of several shapes stepped by the kernel (for the skip test)."""
    g = torch.Generator().manual_seed(seed)
    masters = [torch.randn(s, generator=g).to(device) * 0.1 for s in shapes]
    weights = [m.half() for m in masters]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    keys = [m.clone().requires_grad_() for m in masters]
    ours = cls(keys, lr=1e-3, weight_decay=0.01, fused=fused or None)

    def state_of(key):
        state = ours.state[key]
        if not state:
            state["step"] = torch.zeros((), device=device) if fused else torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(key)
            state["exp_avg_sq"] = torch.zeros_like(key)
        return state

    for _ in range(steps):
        grads16 = [(torch.randn(s, generator=g) * 100).half().to(device) for s in shapes]
        slots = [OnePassSlot(k, gr, None, m, w) for k, gr, m, w in zip(keys, grads16, masters, weights)]
        assert one_pass_reason(ours, ours.param_groups[0], slots) is None
        run_one_pass(ours, ours.param_groups[0], slots, state_of, torch.tensor(2.0, device=device) if fused else None,
                     torch.zeros((), device=device) if fused else None)  # fmt: skip
    return masters, weights, ours, keys


@needs_triton
def test_a_skipped_step_writes_nothing_and_leaves_the_counter(device):
    masters, weights, ours, keys = _case(device, True, True, steps=1)
    before = [t.clone() for t in (*masters, *weights)]
    moments = [ours.state[k]["exp_avg"].clone() for k in keys]
    grads16 = [torch.full_like(w, math.inf) for w in weights]
    slots = [OnePassSlot(k, gr, None, m, w) for k, gr, m, w in zip(keys, grads16, masters, weights)]
    found_inf = torch.ones((), device=device)
    run_one_pass(
        ours,
        ours.param_groups[0],
        slots,
        lambda k: ours.state[k],
        torch.tensor(2.0, device=device),
        found_inf,
    )
    assert all(torch.equal(a, b) for a, b in zip(before, (*masters, *weights)))
    assert all(torch.equal(ours.state[k]["exp_avg"], m) for k, m in zip(keys, moments))
    assert all(float(ours.state[k]["step"]) == 1 for k in keys)


def test_the_kernel_refuses_what_it_does_not_compute(monkeypatch):
    key = torch.zeros(4, requires_grad=True)
    slot = OnePassSlot(
        key, torch.zeros(4, dtype=torch.float16), None, torch.zeros(4), torch.zeros(4, dtype=torch.float16)
    )
    rprop = torch.optim.Rprop([key])
    assert one_pass_reason(rprop, rprop.param_groups[0], [slot]) == "not Adam, AdamW or SGD"
    adamw = torch.optim.AdamW([key])  # on a CPU: the CPU kernel's choice (tests/test_master_cpu_kernel.py)
    assert "not fused=True" in one_pass_reason(adamw, adamw.param_groups[0], [slot])
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton kernel's own refusals
    ams = torch.optim.AdamW([key], amsgrad=True)
    assert "amsgrad" in one_pass_reason(ams, ams.param_groups[0], [slot])
    sgd = torch.optim.SGD([key], lr=0.1)
    assert "SGD off a CPU" in one_pass_reason(sgd, sgd.param_groups[0], [slot])
    bf16 = OnePassSlot(key, slot.grad, None, slot.master, torch.zeros(4, dtype=torch.bfloat16))
    assert one_pass_reason(adamw, adamw.param_groups[0], [bf16]) == "not an FP16 weight"


def _train_with_scaler(device, fused, clip, steps=4, poison_at=2):
    """A small FP16 model through DynamicLossScaler with FP32 masters: scale, backward, (clip), step,
    update; step `poison_at` overflows."""
    from hf_lossscale import DynamicLossScaler, LossScaleConfig

    torch.manual_seed(0)
    model = (
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        .half()
        .to(device)
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g).to(device)
    y = x[:, :1] * 0.5
    scaler = DynamicLossScaler(config=LossScaleConfig(master_weights=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=fused or None)
    for t in range(steps):
        loss = ((model(x.half()).float() - y) ** 2).mean()
        if t == poison_at:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if clip:
            scaler.clip_grad_norm_(opt, 0.5)  # the one-pass clip: the factor carries the clip
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    masters = [pair.master.detach().clone() for pair in opt._hf_lossscale_masters.pairs.values()]
    return model, masters, scaler.stats()["skipped_steps"], opt


@needs_triton
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("clip", [False, True], ids=["", "clip"])
def test_the_scaler_steps_through_the_kernel_as_through_the_chunked_update(device, monkeypatch, fused, clip):
    """The scaler's FP16-weights step with the kernel (where it applies) against the chunked update (the
    CPU's path, bitwise torch's optimizer): the same training within the kernel's rounding, the kernel
    really taken, and the skipped step skipped. Catches: the factor (unscale x clip) not applied, the
    pending gradient read as a cast, the counter moved on the skipped step, the FP16 weight not written."""
    calls = []
    real = master_kernel.run_one_pass

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    import hf_lossscale.masters.optimizer as mw

    monkeypatch.setattr(mw, "run_one_pass", counting)
    model_k, masters_k, skipped_k, opt_k = _train_with_scaler(device, fused, clip)
    # four steps, one skipped: by the scaler on the host (foreach), or inside the kernel (fused: no sync)
    assert len(calls) == (4 if fused else 3) and skipped_k == 1
    kernel_calls = len(calls)
    monkeypatch.setenv("TRITON_INTERPRET", "0") if device == "cpu" else None
    monkeypatch.setattr(master_kernel, "one_pass_reason", lambda *a: "forced off")
    monkeypatch.setattr(mw, "one_pass_reason", lambda *a: "forced off")
    model_c, masters_c, skipped_c, opt_c = _train_with_scaler(device, fused, clip)
    assert len(calls) == kernel_calls and skipped_c == 1
    for a, b in zip(masters_k, masters_c, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    for a, b in zip(model_k.parameters(), model_c.parameters(), strict=True):
        assert a.dtype == torch.float16
        assert (a != b).float().mean() <= 0.01  # the FP16 weights: equal but for a rare rounding tie
    steps = [float(s["step"]) for s in opt_k.state.values()]
    assert steps == [float(s["step"]) for s in opt_c.state.values()] == [3.0] * len(steps)


class _Launches:
    """Counts the kernel's launches (each `kernel[grid](...)`) and the programs of each."""

    def __init__(self, monkeypatch):
        self.grids, self.args, self.kwargs = [], [], []
        real = master_kernel._kernel

        def counting():
            kernel = real()
            launches = self

            class Counted:
                def __getitem__(self, grid):
                    launches.grids.append(grid)

                    def launch(*args, **kwargs):
                        launches.args.append(args)
                        launches.kwargs.append(kwargs)
                        return kernel[grid](*args, **kwargs)

                    return launch

            return Counted()

        counting.cache_clear = real.cache_clear  # the device fixture clears the cache at its end
        monkeypatch.setattr(master_kernel, "_kernel", counting)


def _group(device, shapes, fused=True, seed=3):
    g = torch.Generator().manual_seed(seed)
    masters = [(torch.randn(s, generator=g) * 0.1).to(device) for s in shapes]
    keys = [m.clone().requires_grad_() for m in masters]
    opt = torch.optim.AdamW(keys, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["wd"], fused=fused)  # fmt: skip
    for k in keys:  # a random state, as after a few steps
        opt.state[k].update(step=torch.tensor(4.0, device=device), exp_avg=torch.randn(k.shape, generator=g).to(device) * 1e-2,
                            exp_avg_sq=torch.rand(k.shape, generator=g).to(device) * 1e-3)  # fmt: skip
    return masters, keys, opt, g


def _expected(masters, opt, keys, grads16, factors, grad_scale, step):
    out = []
    for m, k, g16, f in zip(masters, keys, grads16, factors, strict=True):
        st = opt.state[k]
        grad = g16.float() * (f if f is not None else 1.0)
        out.append(cuda_adam_math(m.clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone(), grad, step,
                                  decoupled=True, grad_scale=grad_scale, **HYPER))  # fmt: skip
    return out


@needs_triton
def test_one_launch_steps_a_whole_group_of_many_tensors(device, monkeypatch):
    """A group of tensors of many lengths (several spanning chunks, ends off the block), one launch:
    each tensor's master, moments and FP16 weight as torch's fused arithmetic gives them, each counter
    moved once. Catches: a program table that skips or repeats a chunk, a tensor's row read for
    another (a column or an index off), a per-tensor factor or bias correction taken from the wrong
    tensor, the last chunk's bound taken as the chunk's instead of the tensor's."""
    monkeypatch.setattr(master_kernel, "CHUNK", 2048)
    launches = _Launches(monkeypatch)
    shapes = [(5,), (4096,), (37, 111), (1,), (2048,), (3, 1025)]
    masters, keys, opt, g = _group(device, shapes)
    for i, k in enumerate(keys):  # counters differ per tensor: the corrections are per tensor
        opt.state[k]["step"].fill_(3.0 + i)
    grads16 = [(torch.randn(s, generator=g) * 100).half().to(device) for s in shapes]
    factors = [torch.tensor(0.25 * (i + 1), device=device) if i % 3 else None for i in range(len(shapes))]
    steps = [float(opt.state[k]["step"]) + 1 for k in keys]
    grad_scale = torch.tensor(8.0, device=device)
    expected = [
        _expected([m], opt, [k], [g16], [f], grad_scale, s)[0]
        for m, k, g16, f, s in zip(masters, keys, grads16, factors, steps, strict=True)
    ]
    before = [m.clone() for m in masters]
    weights = [m.half() for m in masters]
    slots = [
        OnePassSlot(k, g16, f, m, w) for k, g16, f, m, w in zip(keys, grads16, factors, masters, weights)
    ]
    group = opt.param_groups[0]
    assert one_pass_reason(opt, group, slots) is None
    assert run_one_pass(opt, group, slots, lambda k: opt.state[k], grad_scale, torch.zeros((), device=device))
    assert len(launches.grids) == 1
    assert launches.grids[0][0] == sum(-(-math.prod(s) // 2048) for s in shapes)  # one program per chunk
    for i, (m, w, k, (param, exp_avg, exp_avg_sq)) in enumerate(zip(masters, weights, keys, expected)):
        errors = _ulp_errors(m, param, before[i])
        assert errors.max() <= 2 and (errors > 1).float().mean() <= 1e-2, f"tensor {i}"
        assert (
            _ulps(opt.state[k]["exp_avg"], exp_avg) <= 1
            and _ulps(opt.state[k]["exp_avg_sq"], exp_avg_sq) <= 1
        )
        assert torch.equal(w, m.half()), f"tensor {i}"
        assert float(opt.state[k]["step"]) == steps[i]


@needs_triton
def test_the_tables_are_kept_for_the_same_tensors_and_made_anew_for_others(device, monkeypatch):
    """A second step over the same tensors copies no table; a gradient at another address gets a table
    of its own (the kernel reads the new gradient, not the one at the old address), and the tables kept
    stay a few. Catches: a cache keyed on the tensors' count or shapes instead of their addresses (the
    step then reads a freed or stale gradient)."""
    copies = []
    real = master_kernel._to_device
    monkeypatch.setattr(master_kernel, "_to_device", lambda *a: copies.append(a[1]) or real(*a))
    shapes = [(300,), (17, 3)]
    masters, keys, opt, g = _group(device, shapes)
    weights = [m.half() for m in masters]
    group = opt.param_groups[0]
    grads16 = [(torch.randn(s, generator=g) * 100).half().to(device) for s in shapes]

    def step(grads):
        slots = [OnePassSlot(k, g16, None, m, w) for k, g16, m, w in zip(keys, grads, masters, weights)]
        assert run_one_pass(opt, group, slots, lambda k: opt.state[k], None, None)

    step(grads16)
    assert copies == [torch.int64, torch.int64]  # the two tables, once (the counters are on the device)
    step(grads16)
    assert len(copies) == 2
    others = [g16.clone() * 0 + 1 for g16 in grads16]  # other addresses, other values
    expected = _expected(
        masters, opt, keys, others, [None, None], None, float(opt.state[keys[0]]["step"]) + 1
    )
    step(others)
    assert len(copies) == 4
    for m, (param, _, _) in zip(masters, expected, strict=True):
        torch.testing.assert_close(m, param, rtol=1e-6, atol=0)
    for _ in range(master_kernel._KEPT + 2):
        step([g16.clone() for g16 in grads16])
    assert len([k for k in master_kernel._Tables._of[opt] if k[0] != "ones"]) == master_kernel._KEPT


@needs_triton
def test_while_capturing_a_graph_the_kernel_does_not_run(device, monkeypatch):
    """During a CUDA graph capture (forced here) `run_one_pass` returns False and moves nothing, even with
    tables kept from a step before the capture (the caller steps the chunked way). Catches: a host copy
    captured into the graph (it reads freed host memory at replay), a kept table the graph points at
    that the cache later drops, a counter moved on a step that did not run."""
    shapes = [(300,), (40,)]
    masters, keys, opt, g = _group(device, shapes)
    weights = [m.half() for m in masters]
    group = opt.param_groups[0]
    grads16 = [(torch.randn(s, generator=g) * 100).half().to(device) for s in shapes]
    slots = [OnePassSlot(k, g16, None, m, w) for k, g16, m, w in zip(keys, grads16, masters, weights)]
    assert run_one_pass(opt, group, slots, lambda k: opt.state[k], None, None)  # before the capture
    monkeypatch.setattr(master_kernel, "_capturing", lambda device: True)
    monkeypatch.setattr(master_kernel, "_to_device", lambda *a: pytest.fail("a host copy while capturing"))
    before = [m.clone() for m in masters]
    assert run_one_pass(opt, group, slots, lambda k: opt.state[k], None, None) is False
    assert all(torch.equal(a, b) for a, b in zip(before, masters))
    assert all(float(opt.state[k]["step"]) == 5 for k in keys)


@needs_triton
def test_a_changed_chunk_gets_tables_of_its_own(device, monkeypatch):
    """The program table is cut at CHUNK: a step after CHUNK changed, over the same tensors, is still
    torch's arithmetic. Catches: a table kept across a CHUNK change (programs overlap and elements are
    updated twice)."""
    shapes = [(5000,)]
    masters, keys, opt, g = _group(device, shapes)
    weights = [m.half() for m in masters]
    group = opt.param_groups[0]
    grads16 = [(torch.randn(s, generator=g) * 100).half().to(device) for s in shapes]
    slots = [OnePassSlot(k, g16, None, m, w) for k, g16, m, w in zip(keys, grads16, masters, weights)]
    monkeypatch.setattr(master_kernel, "CHUNK", 4096)
    assert run_one_pass(opt, group, slots, lambda k: opt.state[k], None, None)
    monkeypatch.setattr(master_kernel, "CHUNK", 1024)
    expected = _expected(masters, opt, keys, grads16, [None], None, float(opt.state[keys[0]]["step"]) + 1)
    before = masters[0].clone()
    assert run_one_pass(opt, group, slots, lambda k: opt.state[k], None, None)
    errors = _ulp_errors(masters[0], expected[0][0], before)
    assert errors.max() <= 2


@needs_triton
def test_a_capture_without_kept_tables_steps_through_the_chunked_update(device, monkeypatch):
    """The scaler's step while capturing with no table kept: the chunked update runs (bitwise torch's
    optimizer on FP32 weights), not a half-done kernel step."""
    monkeypatch.setattr(master_kernel, "_capturing", lambda device: True)
    launches = _Launches(monkeypatch)
    model, masters, skipped, opt = _train_with_scaler(device, True, False)
    monkeypatch.setattr(master_kernel, "one_pass_reason", lambda *a: "forced off")
    import hf_lossscale.masters.optimizer as mw

    monkeypatch.setattr(mw, "one_pass_reason", lambda *a: "forced off")
    _, masters_c, skipped_c, _ = _train_with_scaler(device, True, False)
    assert launches.grids == [] and skipped == skipped_c == 1
    assert all(torch.equal(a, b) for a, b in zip(masters, masters_c, strict=True))


@needs_triton
def test_vector_access_is_claimed_only_for_tensors_whose_addresses_are_aligned(device, monkeypatch):
    """A tensor goes to the launch that tells the compiler its addresses are 16-byte aligned (so the
    compiled kernel moves whole blocks in vectors) only when each of its five block-read addresses is;
    a group mixing both is two launches over one table, and the unaligned tensors still step right. Catches: the
    claim taken from one address or from another tensor, or made for a whole group with an unaligned
    tensor in it (a misaligned vector access on the GPU faults or reads the wrong bytes; the interpreter
    ignores the hints, so only this check sees it)."""
    n = 3000
    masters, keys, opt, g = _group(device, [(n,), (n,)])
    group = opt.param_groups[0]
    grads16 = [(torch.randn(n, generator=g) * 100).half().to(device) for _ in keys]
    weights = [m.half() for m in masters]
    for column in ("grad", "master", "exp_avg", "exp_avg_sq", "weight"):
        state = opt.state[keys[1]]
        parts = {"grad": grads16[1], "master": masters[1], "weight": weights[1]}
        parts.update(exp_avg=state["exp_avg"], exp_avg_sq=state["exp_avg_sq"])
        shifted = torch.empty(n + 1, dtype=parts[column].dtype, device=device)[1:]  # one element off
        shifted.copy_(parts[column])
        parts[column] = shifted
        st = dict(state, exp_avg=parts["exp_avg"], exp_avg_sq=parts["exp_avg_sq"])
        odd = OnePassSlot(keys[1], parts["grad"], None, parts["master"], parts["weight"])
        assert master_kernel._aligned(odd, st) is False, column
        even = OnePassSlot(keys[0], grads16[0], None, masters[0], weights[0])
        assert master_kernel._aligned(even, opt.state[keys[0]]) is True
    # a group of an aligned and an unaligned tensor: two launches, each told what holds for its tensors
    launches = _Launches(monkeypatch)
    shifted = torch.empty(n + 1, device=device)[1:]
    shifted.copy_(masters[1])
    group_masters = [masters[0], shifted]
    expected = _expected(group_masters, opt, keys, grads16, [None, None], None, 5.0)
    before = [m.clone() for m in group_masters]
    ws = [m.half() for m in group_masters]
    slots = [OnePassSlot(k, g16, None, m, w) for k, g16, m, w in zip(keys, grads16, group_masters, ws)]
    assert run_one_pass(opt, group, slots, lambda k: opt.state[k], None, None)
    assert [kw["ALIGNED"] for kw in launches.kwargs] == [True, False]
    assert launches.grids == [(1,), (1,)]
    # over one table (one kept set per group, not one per kind): the second launch's programs follow
    assert launches.args[0][0] is launches.args[1][0] and [a[5] for a in launches.args] == [0, 1]
    for args, kwargs, (n,) in zip(launches.args, launches.kwargs, launches.grids, strict=True):
        table, programs, first = args[0].view(-1, master_kernel._COLUMNS), args[1].view(-1, 2), args[5]
        rows = table[programs[first : first + n, 0]]  # the tensors this launch's programs step
        addresses_aligned = bool((rows[:, [0, 2, 3, 4, 5]] % 16 == 0).all())
        assert addresses_aligned is kwargs["ALIGNED"]  # the hinted launch steps the aligned tensor, only it
    for m, w, (param, _, _), b in zip(group_masters, ws, expected, before, strict=True):
        assert _ulp_errors(m, param, b).max() <= 2 and torch.equal(w, m.half())
    assert [float(opt.state[k]["step"]) for k in keys] == [5.0, 5.0]  # each counter moved once


@needs_triton
def test_a_host_counter_with_a_device_flag_takes_the_chunked_update(device, monkeypatch):
    """A group whose counters are mixed (one on the host, as after loading a for-loop optimizer's state)
    stepped with a device `found_inf`: `run_one_pass` returns False with nothing moved. Catches: the
    flag copied to the host to take the counter back (a sync per step), or subtracted from counters on
    another device than its own (an error mid-step, after the kernel wrote)."""
    masters, keys, opt, g = _group(device, [(300,), (40,)])
    host = opt.state[keys[1]]["step"] = torch.tensor(4.0)  # on the host
    if device == "cpu":  # (the interpreter's "device" is the host: that counter is told apart by name)
        real = master_kernel._counter_on_device
        monkeypatch.setattr(
            master_kernel, "_counter_on_device", lambda step, m: step is not host and real(step, m)
        )
    weights = [m.half() for m in masters]
    grads16 = [(torch.randn(m.shape, generator=g) * 100).half().to(device) for m in masters]
    slots = [OnePassSlot(k, g16, None, m, w) for k, g16, m, w in zip(keys, grads16, masters, weights)]
    before = [m.clone() for m in masters]
    found_inf = torch.zeros((), device=device)
    assert run_one_pass(opt, opt.param_groups[0], slots, lambda k: opt.state[k], None, found_inf) is False
    assert all(torch.equal(a, b) for a, b in zip(before, masters))
    assert [float(opt.state[k]["step"]) for k in keys] == [4.0, 4.0]
    assert run_one_pass(opt, opt.param_groups[0], slots, lambda k: opt.state[k], None, None)  # no flag: runs


@needs_triton
def test_a_parameter_listed_twice_is_updated_once_in_the_launch(device, monkeypatch):
    """A model held in FP16 whose optimizer lists a parameter twice (torch warns that this will become an
    error, and meanwhile steps it twice; the masters update it once): the kernel's launch holds it once, so no two programs race on its elements, and the training is the
    chunked update's. Catches: the group's tensors handed to the kernel without the masters' dedup."""
    from hf_lossscale import DynamicLossScaler, LossScaleConfig

    launches = _Launches(monkeypatch)

    def train():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 1)).half().to(device)
        params = list(model.parameters())
        with pytest.warns(UserWarning, match="duplicate"):
            opt = torch.optim.AdamW(params + params[:1], lr=1e-3, fused=True)
        scaler = DynamicLossScaler(config=LossScaleConfig(master_weights=True))
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)).to(device)
        for _ in range(3):
            scaler.scale(model(x.half()).float().pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()], opt

    kernel_weights, opt = train()
    assert len(launches.grids) == 3
    assert launches.grids[0][0] == sum(-(-p.numel() // master_kernel.CHUNK) for p in kernel_weights)
    assert all(float(s["step"]) == 3 for s in opt.state.values())
    import hf_lossscale.masters.optimizer as mw

    monkeypatch.setenv("TRITON_INTERPRET", "0") if device == "cpu" else None
    monkeypatch.setattr(mw, "one_pass_reason", lambda *a: "forced off")
    chunked_weights, _ = train()
    for a, b in zip(kernel_weights, chunked_weights, strict=True):
        assert (a != b).float().mean() <= 0.01


@needs_triton
def test_moments_the_kernel_cannot_read_flat_take_the_chunked_update(device):
    """A moment that is not a contiguous FP32 tensor of its master's shape (a state loaded from elsewhere,
    transposed): `run_one_pass` returns False with nothing moved. Catches: the kernel reading a
    transposed moment flat (every element paired with another's moment)."""
    masters, keys, opt, g = _group(device, [(16, 8)])
    st = opt.state[keys[0]]
    st["exp_avg"] = st["exp_avg"].t().contiguous().t()  # the same values, column-major
    weights = [m.half() for m in masters]
    grads16 = [(torch.randn(m.shape, generator=g) * 100).half().to(device) for m in masters]
    slots = [OnePassSlot(keys[0], grads16[0], None, masters[0], weights[0])]
    before = masters[0].clone()
    assert run_one_pass(opt, opt.param_groups[0], slots, lambda k: opt.state[k], None, None) is False
    assert torch.equal(before, masters[0]) and float(st["step"]) == 4.0


def _compiled_for_hopper(aligned: bool, has_inf: bool) -> str:
    """The kernel's PTX for sm_90, compiled here without a GPU (Triton bundles ptxas), its pointer
    arguments 16-byte aligned as Triton's launcher specialises torch's allocations."""
    import importlib.util

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    import hf_lossscale.masters.triton_adam as source

    # a copy of the module decorated outside the interpreter (other tests here import it inside)
    spec = importlib.util.spec_from_file_location("triton_adam_compiled", source.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = module.master_adam
    flags = dict(HAS_FACTOR=True, HAS_SCALE=True, HAS_INF=has_inf, HAS_WD=True, DECOUPLED=True, ALIGNED=aligned,
                 COLUMNS=master_kernel._COLUMNS, CHUNK=master_kernel.CHUNK, BLOCK=master_kernel.BLOCK)  # fmt: skip
    pointers = {"table_ptr": "*i64", "programs_ptr": "*i64", "first_program": "i32"}
    signature = {
        name: "constexpr"
        if name in flags
        else pointers.get(name, "*fp32" if name.endswith("_ptr") else "fp32")
        for name in fn.arg_names
    }
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name.endswith("_ptr")}
    options = {"enable_fp_fusion": True, "num_warps": master_kernel.NUM_WARPS}
    return compile(
        ASTSource(fn, signature, flags, attrs), target=GPUTarget("cuda", 90, 32), options=options
    ).asm["ptx"]


@needs_triton
@pytest.mark.parametrize("has_inf", [True, False], ids=["found_inf", "no-flag"])
def test_the_compiled_kernel_moves_aligned_full_blocks_in_vectors(has_inf, monkeypatch):
    """Compiled for an H100 (no GPU needed): with the aligned launch's hints the full blocks load and
    store in vectors, every byte a thread moves there (2 + 4 + 4 + 4 read and 4 + 4 + 4 + 2 written per
    element) in one vector access per tensor, with or without the skip flag; the unaligned launch has
    no vector access at all. Catches: a mask on the full blocks (the skip folded into it, as before),
    the alignment hints lost (pointers loaded from the table carry none), either of which makes every
    access of the hot loop 2 or 4 bytes wide; hints leaking into the unaligned launch (a run-time branch
    on alignment does that: `multiple_of` marks the value, not the branch's use of it)."""
    import re

    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    per_thread = master_kernel.BLOCK // (32 * master_kernel.NUM_WARPS)  # elements per thread and block
    vectors = re.findall(r"(ld|st)\.global\.v(\d)\.b(\d+)", _compiled_for_hopper(True, has_inf))
    moved = {
        op: sum(int(lanes) * int(bits) // 8 for o, lanes, bits in vectors if o == op) for op in ("ld", "st")
    }
    assert moved == {"ld": per_thread * 14, "st": per_thread * 14} and len(vectors) == 8, vectors
    assert not re.findall(r"(ld|st)\.global\.v\d", _compiled_for_hopper(False, has_inf))
