"""`DynamicLossScaler.clip_grad_norm_`: unscale, overflow check and clip in one read of the
gradients, against torch's `GradScaler.unscale_` + `torch.nn.utils.clip_grad_norm_` sequence.

Measured equality (power-of-two scales): the returned norm and the parameters after each step are
bitwise torch's for foreach and single-tensor optimizers, clipped or not, and for fused optimizers
when nothing is clipped; with a fused optimizer that clips, the gradient its kernel uses differs by
at most one ulp per element (the kernel divides by scale / coefficient instead of multiplying twice).
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from sync_count import CountHostReads, count_reads

from hf_lossscale import DynamicLossScaler

OPTIMIZERS = ["adamw_fused", "adamw_foreach", "adamw_single", "sgd_fused", "sgd_foreach", "sgd_single"]


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def make_optimizer(kind, params):
    params = list(params)
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single": {"foreach": False}}
    flag = flags[kind.split("_")[1]]
    if kind.startswith("adamw"):
        # two parameter groups: weights with decay, biases without
        decay = [p for p in params if p.dim() > 1]
        rest = [p for p in params if p.dim() <= 1]
        return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, **flag)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, **flag)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def run(kind, max_norm, *, ours, bad=(), steps=6, norm_type=2.0, scale=2.0**12):
    """Train `steps` steps; at each step in `bad`, put inf/NaN into one gradient element.

    `ours`: `DynamicLossScaler.clip_grad_norm_`; else torch's `GradScaler.unscale_` + `clip_grad_norm_`.
    Returns per-step (norm, scale after, skipped) and the final parameters."""
    model = tiny_model()
    opt = make_optimizer(kind, model.parameters())
    if ours:
        scaler = DynamicLossScaler(init_scale=scale, growth_interval=3)
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=3)
    history = []
    for step in range(steps):
        x, y = batch(step)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        for where, value in bad:
            if where == step:
                model[2].weight.grad[0, step % 4] = value
        if ours:
            norm = scaler.clip_grad_norm_(opt, max_norm, norm_type, parameters=model.parameters())
        else:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        skipped = all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        history.append((norm.item(), scaler.get_scale(), skipped))
        opt.zero_grad()
    return history, [p.detach().clone() for p in model.parameters()]


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("kind", OPTIMIZERS)
@pytest.mark.parametrize("max_norm", [1e9, 0.05], ids=["no-clip", "clip"])
def test_equal_to_torch_unscale_then_clip(kind, max_norm):
    """Bug caught: the norm of the scaled gradients returned (or divided twice), a clip coefficient
    applied without the 1/scale, or a fused kernel that also gets the unscaled gradients."""
    ours, ours_params = run(kind, max_norm, ours=True)
    theirs, their_params = run(kind, max_norm, ours=False)
    clipped = max_norm < 1
    if kind.endswith("fused") and clipped:
        assert ours[0] == theirs[0]  # same gradients in: same norm; the kernels' inputs differ by <= 1 ulp
        for a, b in zip(ours_params, their_params, strict=True):
            # measured: at most 3e-8 apart after the run (a few ulps of lr x update); 1e-7 / 1e-6 holds
            # that with a margin, where a clip coefficient off by 1e-4 would move them by ~1e-5
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        return
    assert ours == theirs  # norms, scales, skips: bitwise
    for a, b in zip(ours_params, their_params, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fused_kernel_gradient_within_one_ulp_of_torch(optimizer):
    """With clipping, a fused kernel gets scale / coefficient as its divisor: the gradient it uses
    is within one ulp of torch's (gradient * 1/scale) * coefficient, element by element. Measured
    through fused SGD with lr 1 from zero parameters, whose result is minus that gradient, and through
    fused AdamW's first step from zero parameters (betas 0: the update is lr * g / (|g| + eps), as
    sensitive to the gradient's last bits as the gradient itself near eps)."""
    worst = 0
    for trial in range(30):
        g = torch.Generator().manual_seed(trial)
        grads = [torch.randn(500, generator=g) * 10.0 ** (trial % 8 - 5) for _ in range(3)]
        results = []
        for ours in (True, False):
            params = [torch.nn.Parameter(torch.zeros(500)) for _ in grads]
            if optimizer == "sgd":
                opt = torch.optim.SGD(params, lr=1.0, fused=True)
            else:  # eps near the gradients' size, so the update keeps their low bits
                opt = torch.optim.AdamW(
                    params, lr=1.0, betas=(0.0, 0.0), eps=1e-3, weight_decay=0.0, fused=True
                )
            scaler = (
                DynamicLossScaler(init_scale=2.0**14)
                if ours
                else torch.amp.GradScaler("cpu", init_scale=2.0**14)
            )
            scaler.scale(torch.ones(()))
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad * 2.0**14
            if ours:
                scaler.clip_grad_norm_(opt, 0.37)
            else:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, 0.37)
            scaler.step(opt)
            results.append(torch.cat([p.detach() for p in params]))
        a, b = (r.view(torch.int32).long() for r in results)
        worst = max(worst, (a - b).abs().max().item())
    print(f"fused {optimizer}, clipped: largest difference {worst} ulp")
    # SGD shows the gradient itself: one ulp. AdamW's update g / (sqrt(g*g) + eps) rounds three more
    # times, which turns a one-ulp gradient difference into at most two in the result (measured: 2).
    assert worst <= {"sgd": 1, "adamw": 2}[optimizer]
    if optimizer == "adamw":  # the same divisor goes to the AdamW kernel: one step matches closely
        ours, theirs = (run("adamw_fused", 0.05, ours=o, steps=1)[1] for o in (True, False))
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(OPTIMIZERS),
    bad=st.lists(
        st.tuples(st.integers(0, 7), st.sampled_from([float("inf"), float("-inf"), float("nan")])),
        max_size=4,
    ),
    max_norm=st.sampled_from([1e9, 0.05]),
    norm_type=st.sampled_from([2.0, float("inf")]),
)
def test_random_overflow_patterns_match_torch(kind, bad, max_norm, norm_type):
    """Skips, scales, norms (non-finite ones included) and parameters, over random overflows.
    Bug caught: a non-finite norm that writes into the gradients or still steps, a back-off that
    differs from torch's, a found-inf flag lost between clip_grad_norm_ and step()."""
    # torch's fused SGD garbles a skipped first step (test_fused_sgd_skipped_first_step): no reference
    assume(not (kind == "sgd_fused" and any(step == 0 for step, _ in bad)))
    ours, ours_params = run(kind, max_norm, ours=True, bad=bad, steps=8, norm_type=norm_type)
    theirs, their_params = run(kind, max_norm, ours=False, bad=bad, steps=8, norm_type=norm_type)
    assert [h[1:] for h in ours] == [h[1:] for h in theirs]  # scales and skips
    exact = not (kind.endswith("fused") and max_norm < 1)
    for (a, *_), (b, *_) in zip(ours, theirs, strict=True):
        assert math.isfinite(a) == math.isfinite(b)
        if exact or not math.isfinite(a):
            assert same(a, b) or (math.isinf(a) and math.isinf(b))
    for a, b in zip(ours_params, their_params, strict=True):
        if exact:
            assert torch.equal(a, b)
        else:  # fused + clip: the kernels' inputs differ by <= 1 ulp (see above)
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def named_setup(kind, init_scale=2.0**10, **config):
    """A model, its optimizer, a scaler that names its parameters, and a batch whose scaled loss
    has been backpropagated once."""
    model = tiny_model()
    opt = make_optimizer(kind, model.parameters())
    scaler = DynamicLossScaler(init_scale=init_scale, **config)
    scaler.set_parameter_names(model)
    x, y = batch(0)
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    return model, opt, scaler, x, y


def bare_reads(opt) -> int:
    """Host reads of one bare optimizer step (its own step counters), gradients zero."""
    for group in opt.param_groups:
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    reads = count_reads(opt.step)
    opt.zero_grad()
    return reads


@pytest.mark.parametrize("kind", ["adamw_fused", "sgd_foreach"])
def test_skipped_step_writes_nothing_and_backs_off(kind):
    model, opt, scaler, x, y = named_setup(kind)
    model[0].weight.grad[1, 1] = float("nan")
    grads = [p.grad.clone() for p in model.parameters()]
    params = [p.detach().clone() for p in model.parameters()]
    norm = scaler.clip_grad_norm_(opt, 0.1)
    assert torch.isnan(norm)
    for g, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, g, equal_nan=True, rtol=0, atol=0)  # values untouched
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters(), strict=True))
    assert scaler.get_scale() == 2.0**9 and scaler.last_step_skipped
    assert scaler.overflow_params == ["0.weight"]  # the first skip is named, from the norms
    assert not opt.state or all(int(s["step"]) == 0 for s in opt.state.values())


def test_norm_in_the_optimizers_order_unless_told():
    """The per-tensor norms are summed in the optimizer's order (here: weights, then biases) unless
    `parameters=` gives another; a set that differs from the optimizer's is refused."""
    model = tiny_model()
    opt = make_optimizer("adamw_foreach", model.parameters())
    scaler = DynamicLossScaler(init_scale=2.0**10)
    scaler.scale(torch.nn.functional.mse_loss(model(batch(1)[0]), batch(1)[1])).backward()
    in_opt_order = [p.grad / 2.0**10 for group in opt.param_groups for p in group["params"]]
    assert torch.equal(scaler.clip_grad_norm_(opt, 1e9), torch.nn.utils.get_total_norm(in_opt_order))
    with pytest.raises(ValueError, match="exactly the optimizer's parameters"):
        scaler.clip_grad_norm_(opt, 1.0, parameters=list(model.parameters())[:2])


@pytest.mark.parametrize("clip", [False, True])
def test_fused_sgd_skipped_first_step(clip):
    """torch's fused SGD with momentum, given found_inf on its first step, skips the update but
    leaves its momentum buffers as torch.empty_like made them (uninitialised memory), and the next
    step applies them. The scaler skips that step itself instead. Bug caught: garbage (or NaN)
    parameters after an overflow on step one, which a high initial scale makes common."""
    results = {}
    for kind in ("sgd_fused", "sgd_foreach"):
        model = tiny_model()
        opt = make_optimizer(kind, model.parameters())
        scaler = DynamicLossScaler(init_scale=2.0**10)
        for step in range(3):
            x, y = batch(step)
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if step == 0:
                model[0].weight.grad[0, 0] = float("inf")
            if clip:
                scaler.clip_grad_norm_(opt, 1e9)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert scaler.stats()["skipped_steps"] == 1
        results[kind] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(results["sgd_fused"], results["sgd_foreach"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_state_machine():
    """No double unscale; a second clip on a fused optimizer divides first; errors after step()."""
    model = tiny_model()
    opt = make_optimizer("adamw_fused", model.parameters())
    scaler = DynamicLossScaler(init_scale=2.0**10)
    x, y = batch(0)
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    reference = [p.grad / 2.0**10 for p in model.parameters()]
    first = scaler.clip_grad_norm_(opt, 1e9)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    second = scaler.clip_grad_norm_(opt, 1e9)  # the plain path, on gradients unscaled now
    assert torch.equal(first, second)
    assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), reference, strict=True))
    scaler.step(opt)  # the kernel must not divide again
    with pytest.raises(RuntimeError, match="after step"):
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.update()

    # unscale_ first, then clip: the plain path on unscaled gradients, torch's norm
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.unscale_(opt)
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert torch.equal(scaler.clip_grad_norm_(opt, 1e9), expected)


def test_parameters_without_gradients_frozen_and_sparse():
    """Sparse gradients take the plain path, which is torch's: here, torch's own refusal (its norm
    has no sparse kernel) after unscale_ ran, not a norm computed some other way."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    dense = torch.nn.Linear(4, 2)
    unused = torch.nn.Linear(4, 2)  # never gets a gradient
    params = [*emb.parameters(), *dense.parameters(), *unused.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    errors = []
    for ours in (True, False):
        scaler = (
            DynamicLossScaler(init_scale=2.0**8) if ours else torch.amp.GradScaler("cpu", init_scale=2.0**8)
        )
        opt.zero_grad()
        scaler.scale(dense(emb(torch.tensor([1, 2, 2]))).sum()).backward()
        with pytest.raises(NotImplementedError) as err:
            if ours:
                scaler.clip_grad_norm_(opt, 0.5)
            else:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, 0.5)
        errors.append((str(err.value).split(".")[0], emb.weight.grad.coalesce().values().clone()))
    assert errors[0][0] == errors[1][0]
    assert torch.equal(errors[0][1], errors[1][1])  # unscaled the same way before torch refused


def test_frozen_parameters():
    model = tiny_model()
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # frozen parameters: grad None
    scaler = DynamicLossScaler(init_scale=4.0)
    scaler.scale(model(batch(0)[0]).sum()).backward()
    expected = torch.nn.utils.get_total_norm([p.grad / 4.0 for p in model[2].parameters()])
    assert torch.equal(scaler.clip_grad_norm_(opt, 1e9), expected)


def test_norm_types_and_modes():
    model = tiny_model()
    x, y = batch(0)
    for norm_type in (2.0, float("inf"), 1.0, 3.0):  # 1 and 3 take the plain path
        for mode in ("dynamic", "static", "off"):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler = DynamicLossScaler(init_scale=2.0**6, mode=mode)
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            expected = torch.nn.utils.get_total_norm(
                [p.grad / (1.0 if mode == "off" else 2.0**6) for p in model.parameters()], norm_type
            )
            assert torch.equal(scaler.clip_grad_norm_(opt, 1e9, norm_type), expected), (norm_type, mode)
            opt.zero_grad()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler()
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    model[0].bias.grad[0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        scaler.clip_grad_norm_(opt, 1.0, error_if_nonfinite=True)


def _run_with_skips(kind, steps=6, skip_at=(2, 3)):
    """A clipped training loop with skipped steps in the middle, for counting host reads."""
    model, opt, scaler, x, y = named_setup(kind, telemetry_interval=2)
    scaler.step(opt)  # the optimizer's state exists (fused SGD reads its flag until then)
    scaler.update()
    opt.zero_grad()

    def loop():
        for step in range(steps):
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if step in skip_at:
                model[2].bias.grad[0] = float("inf")
            scaler.clip_grad_norm_(opt, 0.5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

    return scaler, opt, loop


@pytest.mark.parametrize("kind", ["adamw_fused", "sgd_fused", "adamw_foreach", "sgd_single"])
def test_host_reads_over_a_run_with_skipped_steps(kind):
    """Fused: no host read in any step, skipped or clean (names included). Others: the one read of
    the found-inf flag per step that torch's sequence also has. Bug caught: overflow naming that
    reads gradients back, a norm or skip flag read on the host."""
    scaler, opt, loop = _run_with_skips(kind)
    bare = bare_reads(opt)  # the optimizer's own reads of its step counters (host tensors on CUDA too)
    with CountHostReads() as reads:
        loop()
    added = reads.count - bare * 4  # four clean steps
    assert added == (0 if kind.endswith("fused") else 6), reads.reads
    stats = scaler.stats()
    assert stats["skipped_steps"] == 2
    assert scaler.overflow_params == ["2.bias"]


def test_fewer_reads_than_torch_sequence():
    """Against torch's own sequence with the same optimizer (foreach AdamW): not more reads."""
    model = tiny_model()
    opt = make_optimizer("adamw_foreach", model.parameters())
    theirs = torch.amp.GradScaler("cpu")
    x, y = batch(0)

    def torch_step():
        theirs.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        theirs.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        theirs.step(opt)
        theirs.update()
        opt.zero_grad()

    torch_step()
    _, _, loop = _run_with_skips("adamw_foreach", steps=1, skip_at=())
    assert count_reads(loop) <= count_reads(torch_step)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["adamw_fused", "sgd_fused"])
def test_cuda_clip_path_has_no_sync(kind):
    """Scale, clip_grad_norm_, fused step and update, with telemetry and skipped steps in the
    middle, under `torch.cuda.set_sync_debug_mode("error")` (run by benchmarks/gpu_check.sh).
    Overflow names reach the host later, from non-blocking copies."""
    model = tiny_model().cuda()
    opt = make_optimizer(kind, model.parameters())
    scaler = DynamicLossScaler(init_scale=2.0**10, telemetry_interval=2)
    scaler.set_parameter_names(model)
    x, y = (t.cuda() for t in batch(0))
    for _ in range(2):  # warm up: lazy init, optimizer state, pinned buffers
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norms = []
        for i in range(6):
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if i in (2, 3):
                # skipped steps, still no sync (`grad[0] = inf` would copy the value from the host: a sync)
                model[2].bias.grad[:1].fill_(float("inf"))
            norms.append(scaler.clip_grad_norm_(opt, 0.5))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert [bool(torch.isfinite(n)) for n in norms] == [True, True, False, False, True, True]
    assert scaler.stats()["skipped_steps"] == 2
    assert scaler.overflow_params == ["2.bias"]  # the device is idle: the copies have landed


@pytest.mark.parametrize("kind", ["adamw_fused", "sgd_foreach"])
def test_unscale_path_reads_nothing_more_over_a_run_of_skips(kind):
    """Without clip_grad_norm_ (unscale_ + step, or step alone): a run of three skipped steps adds
    no host read on the fused path (the names of later skips come from non-blocking copies) and
    only the found-inf read on the other. Bug caught: naming the culprits with a `.tolist()` of the
    gradients during a run of skips (the read the fused path used to make)."""
    model, opt, scaler, x, y = named_setup(kind)
    scaler.step(opt)
    scaler.update()
    bare = bare_reads(opt)

    def loop():
        for step in range(5):
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if step in (1, 2, 3):
                model[0].bias.grad[2] = float("nan")
            if step % 2:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

    reads = count_reads(loop) - bare * 2  # two clean steps
    assert reads == (0 if kind == "adamw_fused" else 5)
    assert scaler.stats()["skipped_steps"] == 3
    assert scaler.overflow_params == ["0.bias"]
