"""`torch.compile(fullgraph=True)` of the scaler's calls around an optimizer step.

torch's own `Optimizer.step` breaks the graph on purpose (pytorch#104053: `_use_grad` calls
`torch._dynamo.graph_break()`), so no training step with an optimizer compiles as one graph, torch's
`GradScaler` included (it breaks earlier, in `unscale_`). What a step adds around it does: `scale`,
`clip_grad_norm_` and `update` each compile with `fullgraph=True`, and after one warm-up step they do
not recompile, skipped steps and growth included."""

import pytest
import torch

from hf_lossscale import DynamicLossScaler, LossScaleCollapseError


def _run(compiled: bool, steps: int = 7, inf_at=(3,), **config):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2, **config)
    scale, clip, update = scaler.scale, scaler.clip_grad_norm_, scaler.update
    if compiled:
        scale, clip, update = (torch.compile(f, fullgraph=True) for f in (scale, clip, update))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    scales = []
    for i in range(steps):
        with torch._dynamo.config.patch(error_on_recompile=compiled and i >= 2):  # after the warm-up
            scale(model(x).pow(2).mean()).backward()
            if i in inf_at:
                with torch.no_grad():
                    model[0].weight.grad[0, 0] = float("inf")
            clip(opt, 1.0)
            scaler.step(opt)  # torch's step: eager (see the module docstring)
            update()
        opt.zero_grad(set_to_none=True)
        scales.append(scaler._scale.clone())
    return scaler, [s.item() for s in scales], [p.detach().clone() for p in model.parameters()]


def test_scale_clip_and_update_compile_as_whole_graphs_and_follow_eager():
    """Compiled with fullgraph=True (a graph break is an error), no recompile after the warm-up step,
    and the same trajectory as eager: scales and counters exactly, weights within an ulp or so (the
    compiled norm sums in another order). Bug caught: host reads or data-dependent branches in the
    scaler's calls (a graph break), or per-step Python state the compiled code specialises on (a
    recompile every step)."""
    torch._dynamo.reset()
    eager, eager_scales, eager_params = _run(False)
    comp, comp_scales, comp_params = _run(True)
    assert comp_scales == eager_scales and 1024.0 in comp_scales and 2048.0 in comp_scales  # grew, backed off
    assert comp.stats() == eager.stats() and comp.stats()["skipped_steps"] == 1
    for a, b in zip(comp_params, eager_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_the_collapse_check_still_fires_under_compile():
    """The observers' host work (the collapse check) cannot be traced: it runs at the next eager call.
    Bug caught: compiled updates that silently never check for a collapse."""
    torch._dynamo.reset()
    with pytest.raises(LossScaleCollapseError):
        scaler, _, _ = _run(True, steps=5, inf_at=(2, 3, 4), max_consecutive_skips=3)
        scaler.stats()


def _graph_model_and_batch(device: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(device)
    return model, torch.randn(4, 8, device=device, generator=torch.Generator(device).manual_seed(1))


def _graph_step(model, opt, scaler, x, poison, clip=False):
    """One step whose backward overflows when `poison` is huge (the forward value is unchanged)."""
    opt.zero_grad(set_to_none=False)
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(x)
    out = out.float()
    out = out + (out - out.detach()) * poison  # d(out) is multiplied by 1 + poison; the value is not
    scaler.scale(out.pow(2).mean()).backward()
    if clip:
        scaler.clip_grad_norm_(opt, 0.1)  # small enough to clip these gradients
    scaler.step(opt)
    scaler.update()


@pytest.mark.cuda
@pytest.mark.parametrize("clip", [False, True], ids=["no_clip", "clip"])
def test_a_step_captures_in_a_cuda_graph_and_replays_with_skipped_steps(clip):
    """Scale, backward, (with `clip`, the one-pass clip), fused AdamW's step and update captured once
    in a CUDA graph and replayed 8 times, the backward overflowing at replays 3 and 4: the scales and the counters follow an eager
    run of the same steps exactly, the weights within an ulp or so. Bug caught: a host read or a
    host-side decision in the step (capture fails: "operation not permitted when stream is
    capturing"), or state that only Python advances (replays would not back off or count skips).
    Written before any GPU was lent: `benchmarks/gpu_check.sh` runs it first (step 1)."""
    device, overflow_at = "cuda", (3, 4)

    def make():
        model, x = _graph_model_and_batch(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
        scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2, telemetry_interval=0)
        return model, opt, scaler, x

    model, opt, scaler, x = make()
    poison = torch.zeros((), device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (lazy state, kernels), as CUDA graph capture requires
        for _ in range(2):
            _graph_step(model, opt, scaler, x, poison, clip)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _graph_step(model, opt, scaler, x, poison, clip)
    graph_scales = []
    for i in range(8):
        poison.fill_(1e38 if i in overflow_at else 0.0)
        graph.replay()
        graph_scales.append(scaler._scale.item())

    # the same steps eagerly: the two warm-up steps, then the eight (capturing runs no kernel)
    ref_model, ref_opt, ref, ref_x = make()
    ref_poison = torch.zeros((), device=device)
    for _ in range(2):
        _graph_step(ref_model, ref_opt, ref, ref_x, ref_poison, clip)
    ref_scales = []
    for i in range(8):
        ref_poison.fill_(1e38 if i in overflow_at else 0.0)
        _graph_step(ref_model, ref_opt, ref, ref_x, ref_poison, clip)
        ref_scales.append(ref._scale.item())
    assert graph_scales == ref_scales and min(graph_scales) < max(graph_scales)
    theirs, ours = ref.stats(), scaler.stats()
    for key in ("loss_scale", "skipped_steps", "consecutive_skips"):
        assert ours[key] == theirs[key], key
    assert ours["skipped_steps"] == len(overflow_at)
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
