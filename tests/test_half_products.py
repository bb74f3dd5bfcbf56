"""`fp16_products()`: a model held in FP16 computes its matrix products on FP32 kernels with one FP16
rounding (a GPU's FP16 arithmetic), forward and backward, and nothing else changes."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_bert_classifier, tiny_classification_dataset

import hf_lossscale.fp16.emulation as emulation
import hf_lossscale.integrations.trainer as trainer_module
from hf_lossscale import LossScaleTrainer, LossScaleTrainingArguments, fp16_emulation
from hf_lossscale.fp16.half_products import fp16_products


def _half(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).half()


def _products():
    """(name, function of FP16 tensors) for each product the mode takes, forward and backward."""
    a, b, c = _half(8, 40), _half(40, 6, seed=1), _half(8, 6, seed=2)
    x, y, z = _half(3, 8, 40, seed=3), _half(3, 40, 6, seed=4), _half(3, 8, 6, seed=5)
    img, kernel = _half(2, 3, 9, 9, seed=6), _half(4, 3, 3, 3, seed=7)
    q, k, v = _half(2, 2, 16, 8, seed=8), _half(2, 2, 16, 8, seed=9), _half(2, 2, 16, 8, seed=10)
    return [
        ("mm", lambda: a @ b),
        ("addmm", lambda: torch.addmm(c, a, b, beta=0.5, alpha=2.0)),
        ("bmm", lambda: x @ y),
        ("baddbmm", lambda: torch.baddbmm(z, x, y)),
        ("mv", lambda: a @ b[:, 0]),
        ("conv2d", lambda: F.conv2d(img, kernel, padding=1)),
        ("sdpa", lambda: F.scaled_dot_product_attention(q, k, v)),
    ]


def _as_fp32_then_round(fn):
    """The reference, right by construction: the same product of FP32 copies, rounded once to FP16."""
    originals = {}

    def up(t):
        return t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.float16 else t

    # evaluate fn with its FP16 closure tensors cast to FP32 by running it under a mode that casts
    class Up(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            from torch.utils._pytree import tree_map

            originals[func] = True
            return func(*tree_map(up, args), **tree_map(up, kwargs or {}))

    with Up():
        out = fn()
    return out.half()


@pytest.mark.parametrize("name", [n for n, _ in _products()])
def test_each_product_is_the_fp32_product_rounded_once(name):
    fn = dict(_products())[name]
    with fp16_products() as mode:
        got = fn()
    assert got.dtype == torch.float16
    assert mode.calls >= 1
    assert torch.equal(got, _as_fp32_then_round(fn))
    # and the native CPU FP16 kernel agrees to its summation order (values of a few units: 2^-7)
    native = fn()
    torch.testing.assert_close(got.float(), native.float(), rtol=2e-3, atol=4e-3)


def test_backward_products_give_fp16_gradients_equal_to_the_rounded_fp32_ones():
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 10).half()
    conv = torch.nn.Conv1d(2, 3, 3).half()
    x = torch.randn(5, 24).half()
    seq = torch.randn(4, 2, 11).half()
    with fp16_products() as mode:
        (layer(x).float().pow(2).sum() + conv(seq).float().sum()).backward()
    grads = [p.grad.clone() for p in (*layer.parameters(), *conv.parameters())]
    assert all(g.dtype == torch.float16 for g in grads)
    assert mode.calls == 4  # addmm and convolution forward; mm (the weight gradient) and convolution_backward
    # reference: FP32 copies of the same module, each product's output rounded to FP16 by hand
    w, bias = layer.weight.float(), layer.bias.float()
    out = (x.float() @ w.t() + bias).half()
    g_out = (2 * out.float()).half()  # pow(2)'s gradient in FP32 on the FP32 upcast, rounded at the cast
    assert torch.equal(grads[0], (g_out.float().t() @ x.float()).half())
    # the convolution's weight gradient through an FP32 convolution_backward, rounded once
    with torch.no_grad():
        ref = torch.ops.aten.convolution_backward.default(
            torch.ones(4, 3, 9),
            seq.float(),
            conv.weight.float(),
            [3],
            [1],
            [0],
            [1],
            False,
            [0],
            1,
            [True, True, True],
        )
    assert torch.equal(grads[2], ref[1].half()) and torch.equal(grads[3], ref[2].half())


def test_sdpa_keeps_its_logsumexp_in_fp32_and_its_backward_runs_through_the_mode():
    q = _half(1, 2, 8, 4).requires_grad_()
    seen = []

    class Watch(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "flash_attention_for_cpu" in str(func) and "backward" not in str(func):
                seen.append(out[1].dtype)
            return out

    with fp16_products(), Watch():  # the watch, entered last, sees what the products mode returns
        F.scaled_dot_product_attention(q, q, q).float().sum().backward()
    assert seen == [torch.float32]
    assert q.grad.dtype == torch.float16 and torch.isfinite(q.grad).all()


def test_fp32_and_mixed_inputs_are_left_to_torch():
    a32, b32 = torch.randn(4, 5), torch.randn(5, 3)
    with fp16_products() as mode:
        assert torch.equal(a32 @ b32, torch.mm(a32, b32))
        with pytest.raises(RuntimeError):  # torch refuses FP16 @ FP32; the mode does not hide it
            a32.half() @ b32
    assert mode.calls == 0


def test_a_model_held_in_fp16_trains_identically_under_the_emulation_and_the_products_mode():
    """`fp16_emulation()` enters `fp16_products()`: an FP16 model's step is the same under either."""
    steps = []
    for context in (fp16_emulation, fp16_products):
        model = tiny_bert_classifier().half()
        ids = torch.randint(5, 100, (4, 12), generator=torch.Generator().manual_seed(0))
        with context():
            model(input_ids=ids, labels=torch.tensor([0, 1, 1, 0])).loss.backward()
        steps.append([p.grad for p in model.parameters() if p.grad is not None])
    assert all(torch.equal(a, b) for a, b in zip(*steps))
    assert all(g.dtype == torch.float16 for g in steps[0])


@pytest.fixture
def recorded_modes(monkeypatch):
    """Every FP16Products mode the integrations enter, with its product count."""
    modes = []

    @contextlib.contextmanager
    def recording():
        with fp16_products() as mode:
            modes.append(mode)
            yield mode

    monkeypatch.setattr(trainer_module, "fp16_products", recording)
    monkeypatch.setattr(emulation, "fp16_products", recording)
    return modes


def _trainer(tmp_path, **kw):
    args = LossScaleTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=2,
                                      report_to=[], save_strategy="no", disable_tqdm=True, **kw)  # fmt: skip
    return LossScaleTrainer(model=tiny_bert_classifier().half(), args=args, train_dataset=tiny_classification_dataset(),
                            eval_dataset=tiny_classification_dataset(n=8))  # fmt: skip


@pytest.mark.parametrize("fp16", [False, True])
def test_trainer_runs_an_fp16_models_products_on_fp32_kernels(tmp_path, recorded_modes, fp16):
    """Pure FP16 (no `--fp16`) and FP16 weights with masters (`--fp16`, emulated): forward, backward
    and evaluation all go through the mode."""
    trainer = _trainer(tmp_path, fp16=fp16)
    trainer.train()
    trainer.evaluate()
    assert len(recorded_modes) >= 5  # 2 forwards, 2 backwards, 1 evaluation at least
    assert all(mode.calls > 0 for mode in recorded_modes)
    assert all(p.dtype == torch.float16 for p in trainer.model.parameters())


def test_native_fp16_on_cpu_opts_out(tmp_path, recorded_modes):
    trainer = _trainer(tmp_path, fp16=False, loss_scale_fp16_on_cpu="native")
    trainer.train()
    assert recorded_modes == []


def test_attention_backward_and_inference_mode_go_through_the_mode():
    """Bugs caught: the attention backward (FP16 inputs and its FP32 logsumexp) left to the CPU's FP16
    kernel; `linear`, which reaches the dispatcher whole under `torch.inference_mode()`, left too."""
    q = _half(2, 2, 16, 8).requires_grad_()
    with fp16_products() as mode:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).float().sum().backward()
    assert mode.calls == 2 and q.grad.dtype == torch.float16
    layer, x = torch.nn.Linear(40, 6).half(), _half(8, 40)
    with torch.inference_mode(), fp16_products() as mode:
        out = layer(x)
    assert mode.calls == 1
    with torch.no_grad():
        expected = (x.float() @ layer.weight.float().t() + layer.bias.float()).half()
    assert torch.equal(out, expected)


def test_a_model_from_model_init_goes_through_the_mode(tmp_path, recorded_modes):
    """Bug caught: the choice made when the Trainer was built, while `model_init` had not yet made the
    model (the run then used the CPU's slow FP16 kernels, silently)."""
    args = LossScaleTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=2,
                                      report_to=[], save_strategy="no", disable_tqdm=True)  # fmt: skip
    trainer = LossScaleTrainer(model_init=lambda: tiny_bert_classifier().half(), args=args,
                               train_dataset=tiny_classification_dataset())  # fmt: skip
    trainer.train()
    assert len(recorded_modes) >= 4 and all(mode.calls > 0 for mode in recorded_modes)
