"""Defects reproduced from outside (issue 37): each test fails on the code before its fix."""

import copy
import json
import pickle

import pytest
import torch

from hf_lossscale import DynamicLossScaler


def _train(optimizer_kind, roundtrip, steps=8, overflow_at=(2, 3), **scaler_kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    if optimizer_kind == "fused_adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    elif optimizer_kind == "fused_sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    scaler = DynamicLossScaler(init_scale=256.0, growth_interval=100, **scaler_kw)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    scales = []
    for i in range(steps):
        opt.zero_grad()
        scaler.scale(model(x).pow(2).mean()).backward()
        if i in overflow_at:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        if roundtrip:
            scaler = roundtrip(scaler)
    return scales, scaler.stats(), [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("optimizer_kind", ["fused_adamw", "fused_sgd", "foreach_adamw"])
@pytest.mark.parametrize("hysteresis", [1, 2])
def test_a_scaler_pickled_after_every_update_trains_as_one_never_pickled(optimizer_kind, hysteresis):
    """torch's own GradScaler tests pickle the scaler after every update. Bug caught: the counters'
    views and the flags buffer's views came back unshared, so `total_steps` froze, skips went
    uncounted and, on fused optimizers, update() no longer saw the overflows (256 grew to 4096)."""
    kw = {"hysteresis": hysteresis}
    ref_scales, ref_stats, ref_params = _train(optimizer_kind, None, **kw)
    got_scales, got_stats, got_params = _train(optimizer_kind, lambda s: pickle.loads(pickle.dumps(s)), **kw)
    assert got_scales == ref_scales and min(ref_scales) < 256.0
    for key in ("total_steps", "skipped_steps", "consecutive_skips", "loss_scale"):
        assert got_stats[key] == ref_stats[key], key
    assert ref_stats["total_steps"] == 8 and ref_stats["skipped_steps"] == 2
    for a, b in zip(got_params, ref_params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_deepcopy_and_pickle_agree():
    _, by_pickle, _ = _train("fused_adamw", lambda s: pickle.loads(pickle.dumps(s)))
    _, by_deepcopy, _ = _train("fused_adamw", copy.deepcopy)
    assert by_pickle == by_deepcopy


def test_a_deep_copy_of_a_model_with_fp32_modules_runs_its_own_weights():
    """Bug caught: the FP32 wrapper was a closure bound to the original module, so a deep copy (EMA,
    `AveragedModel`, TRL's reference model) ran the original's weights, and pickling the model failed."""
    from hf_lossscale.fp16.fp32_modules import fp32_module_names, run_in_fp32, unwrap

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert run_in_fp32(model, ["0"]) == ["0"]
    x = torch.randn(3, 4)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[0].weight.mul_(3)
    assert not torch.allclose(twin(x), model(x))
    assert torch.equal(twin(x), twin[2](twin[1](torch.nn.functional.linear(x, twin[0].weight, twin[0].bias))))
    restored = pickle.loads(pickle.dumps(model))
    assert torch.equal(restored(x), model(x)) and fp32_module_names(restored) == ["0"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model[0](x).dtype == torch.float32  # still outside autocast
    unwrap(model[0])
    assert "forward" not in model[0].__dict__ and fp32_module_names(model) == []


def test_a_lock_file_is_never_seen_empty_and_a_second_lock_in_a_process_is_refused(tmp_path):
    """Bug caught: the pid was written after the O_EXCL create, so a runner reading the empty file in
    between took the lock from a live owner; and a second lock in the same process re-entered, its
    exit dropping the first's. Since issue 47 the lock is an `flock`: what decides is the kernel's
    lock, not the file's content, so another process is refused even while the file is empty."""
    import os
    import subprocess
    import sys

    from hf_lossscale.tools.files import DirectoryLock, LockedError

    other = [sys.executable, "-c", "import sys; from hf_lossscale.tools.files import DirectoryLock as L\n"
             "try:\n    L(sys.argv[1]).__enter__()\nexcept Exception as e:\n    print(e)\n    sys.exit(3)",
             str(tmp_path)]  # fmt: skip
    with DirectoryLock(tmp_path, what="first") as first:
        assert first.path.read_text() == str(os.getpid())
        first.path.write_text("")  # seen empty: still held
        refused = subprocess.run(other, capture_output=True, text=True)
        assert refused.returncode == 3 and "is in use" in refused.stdout, refused.stdout + refused.stderr
        with pytest.raises(LockedError, match="in this process"):
            DirectoryLock(tmp_path, what="second").__enter__()
    assert not (tmp_path / DirectoryLock.NAME).exists()
    (tmp_path / DirectoryLock.NAME).write_text("999999999")  # a dead owner's lock is taken over
    with DirectoryLock(tmp_path):
        pass
    assert not list(tmp_path.glob("*.tmp"))


def test_a_config_file_nests_loss_scale_beside_other_keys(tmp_path):
    """Bug caught: a file with `loss_scale:` beside other tools' keys was refused (only a file holding
    `loss_scale:` alone was read as nested), though the docstring invites it."""
    from hf_lossscale import LossScaleConfig
    from hf_lossscale.core.config import resolve_config

    path = tmp_path / "train.yaml"
    path.write_text("learning_rate: 2.0e-5\nloss_scale:\n  init_scale: 1024\n  growth_interval: 50\n")
    assert LossScaleConfig.from_file(path).init_scale == 1024
    config = resolve_config(environ={"HF_LOSSSCALE_CONFIG": str(path)})
    assert (config.init_scale, config.growth_interval) == (1024, 50)


def test_environment_variables_are_read_exactly_and_errors_name_their_sources():
    """Bugs caught: a blank HF_LOSSSCALE_MAX_CONSECUTIVE_SKIPS silently disabled the collapse check;
    0 was refused where the flag means "disable"; 2**63 - 1 went through float() and was refused as
    ...808; a cross-field error named neither the variable nor the other field's source."""
    from hf_lossscale.core.config import resolve_config

    with pytest.raises(ValueError, match="HF_LOSSSCALE_MAX_CONSECUTIVE_SKIPS is set but empty"):
        resolve_config(environ={"HF_LOSSSCALE_MAX_CONSECUTIVE_SKIPS": "  "})
    assert resolve_config(environ={"HF_LOSSSCALE_MAX_CONSECUTIVE_SKIPS": "0"}).max_consecutive_skips is None
    big = resolve_config(environ={"HF_LOSSSCALE_MAX_CONSECUTIVE_SKIPS": str(2**63 - 1)})
    assert big.max_consecutive_skips == 2**63 - 1
    assert resolve_config(environ={"HF_LOSSSCALE_GROWTH_INTERVAL": "1e3"}).growth_interval == 1000
    with pytest.raises(ValueError) as err:
        resolve_config(environ={"HF_LOSSSCALE_MIN_SCALE": "1e9"})
    assert "min_scale set by environment variable HF_LOSSSCALE_MIN_SCALE" in str(err.value)
    assert "max_scale at its default" in str(err.value)


def test_scale_takes_a_generator_of_losses_as_torchs_scaler_does():
    """Bug caught: a generator was refused with a message saying scale() takes an iterable."""
    scaler = DynamicLossScaler(init_scale=8.0)
    losses = [torch.tensor(1.0), torch.tensor(2.0)]
    scaled = list(scaler.scale(loss for loss in losses))
    assert [float(x) for x in scaled] == [8.0, 16.0]
    torch_scaled = list(torch.amp.GradScaler("cpu", init_scale=8.0).scale(loss for loss in losses))
    assert [float(x) for x in torch_scaled] == [8.0, 16.0]
    with pytest.raises(ValueError, match="got generator without a Tensor"):
        scaler.scale(x for x in [])


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_dropped_iteration_does_not_skip_the_next_clean_step(fused):
    """A non-finite loss scaled and backpropagated, then dropped by hand (`zero_grad(); continue`):
    torch's scaler steps the next, clean iteration. Bug caught: the dropped loss's probe stayed and
    made that step a skip, counted as a non-finite loss."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused, foreach=not fused)
    scaler = DynamicLossScaler(init_scale=16.0)
    x = torch.randn(8, 4)
    for i in range(3):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        if i == 1:
            scaler.scale(loss * float("nan")).backward()
            opt.zero_grad()
            continue  # the bad batch dropped
        before = model.weight.detach().clone()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        assert not torch.equal(model.weight, before), f"iteration {i} was skipped"
    stats = scaler.stats()
    assert stats["skipped_steps"] == 0 and stats["total_steps"] == 2 and stats["loss_scale"] == 16.0
    # accumulation is not mistaken for a drop: a NaN micro-batch among kept ones still skips
    opt.zero_grad()
    scaler.scale(model(x).pow(2).mean()).backward()
    scaler.scale(model(x).pow(2).mean() * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.stats()["skipped_steps"] == 1


def test_a_frozen_fp16_module_runs_in_fp32_with_fp32_copies():
    """A LoRA-style frozen FP16 base module listed in fp32_modules (or moved there by "auto" mid-run).
    Bug caught: its FP32 inputs met its FP16 weights ("mat1 and mat2 must have the same dtype")."""
    from hf_lossscale.fp16.fp32_modules import run_in_fp32

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4).half().requires_grad_(False), torch.nn.Linear(4, 2))
    run_in_fp32(model, ["0"])
    x = torch.randn(3, 4)
    out = model(x)
    w = model[0].weight.float()
    torch.testing.assert_close(out, model[1](torch.nn.functional.linear(x, w, model[0].bias.float())))
    out.sum().backward()
    assert model[1].weight.grad is not None and model[0].weight.grad is None
    assert model[0].weight.dtype == torch.float16  # the module keeps its FP16 weights
    trainable = torch.nn.Linear(4, 2).half()  # a trainable FP16 module gets its gradient through the cast
    run_in_fp32(torch.nn.Sequential(trainable), ["0"])
    trainable(x).sum().backward()
    assert trainable.weight.grad.dtype == torch.float16


def test_auto_does_not_move_a_module_that_runs_in_fp32_already():
    """Bug caught: "auto" re-added a module configured (or kept by the model) in FP32, said it moved,
    and counted it against max_auto_fp32_modules."""
    from hf_lossscale.fp16.fp32_modules import run_in_fp32
    from hf_lossscale.integrations.callbacks import OverflowDiagnosisCallback

    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Linear(2, 2))
    run_in_fp32(model, ["0"])
    scaler = DynamicLossScaler(fp32_modules="auto", max_auto_fp32_modules=1)
    callback = OverflowDiagnosisCallback(trainer=None)
    callback._move_to_fp32(scaler, model, "0.0", step=3)  # inside the configured FP32 module
    assert scaler.state.fp32_modules == []
    assert (
        callback.events[-1]["event"] == "fp32_module_refused"
        and "FP32 already" in callback.events[-1]["reason"]
    )
    callback._move_to_fp32(scaler, model, "1", step=4)  # the cap is still free for a real move
    assert scaler.state.fp32_modules == ["1"] and callback.events[-1]["event"] == "fp32_module_added"


def _text(tmp_path):
    text = tmp_path / "train.txt"
    text.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog again" for i in range(200)))
    return text


def test_preflight_refuses_bad_options_before_loading_or_measuring(tmp_path):
    """Bugs caught: `--steps 0` said "Not enough text"; an empty --train_file gave a raw
    DatasetGenerationError; an unwritable --output_json failed only after the measurement."""
    from hf_lossscale.tools.cli import main

    text, empty = _text(tmp_path), tmp_path / "empty.txt"
    empty.write_text("\n \n")
    base = ["preflight", "--model_name_or_path", str(tmp_path / "no-model-needed"), "--block_size", "16"]
    with pytest.raises(SystemExit, match="--steps 0"):
        main([*base, "--train_file", str(text), "--steps", "0"])
    with pytest.raises(SystemExit, match="holds no text"):
        main([*base, "--train_file", str(empty)])
    with pytest.raises(SystemExit, match="cannot write there"):
        main([*base, "--train_file", str(text), "--output_json", str(tmp_path / "missing" / "p.json")])


def test_preflight_exits_2_when_the_overflow_is_in_the_models_own_forward(monkeypatch, capsys):
    """An overflow that starts outside every submodule (the model's own forward or its loss) is still
    an FP16 overflow. Bug caught: "no overflow" and exit 0 (the docs promise 2)."""
    from hf_lossscale.fp16 import preflight as pf
    from hf_lossscale.tools.cli import main

    class OwnForward(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return (self.lin(x) * 1e6).pow(2).mean()  # above 65504 in the model's own code

    torch.manual_seed(0)
    result = pf.preflight(OwnForward(), [torch.randn(2, 4)], lambda m, b: m(b))
    assert result["overflow_outside_modules"] and result["suggested_fp32_modules"] == []
    assert "model's own forward" in pf.format_preflight(result)
    from hf_lossscale.tools import preflight as command

    monkeypatch.setattr(command, "run", lambda opts: result)
    assert main(["preflight", "--model_name_or_path", "x", "--train_file", "y"]) == 2


def test_preflight_measures_a_classifier_checkpoint_as_a_classifier(tmp_path, capsys):
    """Bug caught: a sequence-classification checkpoint was loaded as an MLM (its head reported
    missing / unexpected), where run_glue.py users load the checkpoint's own architecture."""
    from tiny_models import minilm_path, tiny_bert_config
    from transformers import AutoTokenizer, BertForSequenceClassification

    from hf_lossscale.tools.cli import main

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    torch.manual_seed(0)
    model = BertForSequenceClassification(tiny_bert_config(vocab_size=tokenizer.vocab_size, num_labels=3))
    model.save_pretrained(tmp_path / "clf")
    tokenizer.save_pretrained(tmp_path / "clf")
    out = tmp_path / "p.json"
    code = main(["preflight", "--model_name_or_path", str(tmp_path / "clf"), "--objective", "mlm",
                 "--train_file", str(_text(tmp_path)), "--block_size", "16", "--steps", "1",
                 "--output_json", str(out)])  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0 and "sequence classifier" in printed.out
    assert "MISSING" not in printed.out + printed.err and "UNEXPECTED" not in printed.out + printed.err
    assert any(name.startswith("classifier") for name in json.loads(out.read_text())["modules"])
