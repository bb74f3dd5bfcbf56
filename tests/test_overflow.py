"""Forward overflows (no scale can fix them) told from backward ones, their origin named, and the
remedy: modules that run in FP32 (`fp32_modules`, `"auto"`), the pre-flight check, and the floor."""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
from tiny_models import scaler_step as _step
from tiny_models import tiny_bert_classifier, tiny_classification_dataset

from hf_lossscale import DynamicLossScaler, LossScaleCollapseError, LossScaleConfig, fp16_emulation
from hf_lossscale.core.overflow import find_overflow_origin
from hf_lossscale.fp16.fp32_modules import fp32_module_names, modules_matching, run_in_fp32, unwrap
from hf_lossscale.fp16.preflight import format_preflight, preflight

ROOT = Path(__file__).resolve().parents[1]
QUERY = "bert.encoder.layer.1.attention.self.query"


def _bench():
    spec = importlib.util.spec_from_file_location(
        "forward_overflow", ROOT / "benchmarks" / "forward_overflow.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def overflowing_bert(seed=0):
    """A tiny BERT classifier whose layer-1 query carries activations far above 65504 (by the
    benchmark's FP32-preserving rescaling), and the plain one it came from."""
    plain = tiny_bert_classifier(seed)
    model = tiny_bert_classifier(seed)
    _bench().rescale_attention(model, 1, 20)
    return model, plain


def batch(n=4, seq=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 100, (n, seq), generator=g)
    return {"input_ids": ids, "labels": (ids[:, 0] > 50).long()}


def loss_fn(model, b):
    return model(**b).loss


# ---------------------------------------------------------------------- the scaler: forward vs backward
@pytest.mark.parametrize("fused", [False, True])
def test_nonfinite_loss_skips_even_with_finite_gradients_and_spares_the_scale(fused):
    """Bug caught: the loss flag not folded into the skip decision (a NaN loss with finite gradients
    stepped), or a forward overflow backing the scale off as a gradient overflow does."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    scaler = DynamicLossScaler(init_scale=2.0**10)
    before = [p.detach().clone() for p in model.parameters()]
    _step(scaler, model, opt, loss_nan=True)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    s = scaler.stats()
    assert (s["skipped_steps"], s["nonfinite_loss_steps"], s["loss_scale"]) == (1, 1, 2.0**10)
    assert bool(scaler.last_loss_nonfinite) and not bool(scaler.last_backed_off)
    _step(scaler, model, opt, grad_inf=True)  # a backward overflow still backs off
    s = scaler.stats()
    assert (s["skipped_steps"], s["nonfinite_loss_steps"], s["loss_scale"]) == (2, 1, 2.0**9)
    assert s["consecutive_nonfinite_loss"] == 0 and s["consecutive_skips"] == 2


def test_backoff_on_nonfinite_loss_restores_torchs_rule():
    """Bug caught: the config field ignored (torch's behaviour unreachable)."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**10, backoff_on_nonfinite_loss=True)
    _step(scaler, model, opt, loss_nan=True)
    assert scaler.stats()["loss_scale"] == 2.0**9 and scaler.stats()["nonfinite_loss_steps"] == 1


def test_forward_overflow_keeps_the_growth_streak_and_the_hysteresis_budget():
    """A forward overflow is neither a clean step nor a gradient overflow: the growth tracker and the
    hysteresis budget stay. Bug caught: the streak reset (a transient bad batch delaying growth by a
    whole interval) or the budget spent."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = DynamicLossScaler(init_scale=2.0**4, growth_interval=3, hysteresis=2)
    _step(scaler, model, opt)
    _step(scaler, model, opt)
    _step(scaler, model, opt, loss_nan=True)
    s = scaler.stats()
    assert (s["growth_tracker"], s["hysteresis_tracker"], s["loss_scale"]) == (2, 2, 2.0**4)
    _step(scaler, model, opt)  # the third clean step of the streak grows the scale
    assert scaler.stats()["loss_scale"] == 2.0**5


def test_clean_steps_read_nothing_more_from_the_device():
    """The loss flag stays on the device: a clean fused step reads nothing on the host. Bug caught: a
    `bool()`/`.item()` of the loss flag in scale() or update()."""
    from sync_count import CountHostReads

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = DynamicLossScaler(init_scale=2.0**10)
    _step(scaler, model, opt)
    with CountHostReads() as reads:
        for _ in range(3):
            _step(scaler, model, opt)
    assert reads.count == 0, reads.reads


def test_collapse_counts_both_kinds_and_leads_with_the_origin():
    """Bug caught: the error listing parameters only (the embeddings, first in order) with no word of
    the forward overflow, or miscounting which kind the skips were."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**4, max_consecutive_skips=3)
    scaler.overflow_origin = {"kind": "forward", "origin": "encoder.layer.3.mlp.down_proj"}
    _step(scaler, model, opt, grad_inf=True)
    _step(scaler, model, opt, loss_nan=True)
    with pytest.raises(LossScaleCollapseError) as info:
        _step(scaler, model, opt, loss_nan=True)
    text = str(info.value)
    assert text.startswith("Forward overflow in `encoder.layer.3.mlp.down_proj`")
    assert "2 of them with a non-finite loss" in text and "1 with non-finite gradients only" in text
    assert info.value.origin == "encoder.layer.3.mlp.down_proj" and info.value.kind == "forward"
    assert info.value.nonfinite_loss_steps == 2


# ---------------------------------------------------------------------- the floor
def test_at_min_scale_warn_keeps_going_once_warned():
    """Bug caught: "warn" raising anyway, or warning on every step."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0, max_consecutive_skips=2, at_min_scale="warn")
    with pytest.warns(UserWarning, match="Loss scale collapsed") as record:
        for _ in range(5):
            _step(scaler, model, opt, grad_inf=True)
    assert sum("collapsed" in str(w.message) for w in record) == 1
    assert [e["event"] for e in scaler.drain_events()] == ["collapse_warning"]


@pytest.mark.parametrize("fused", [False, True])
def test_at_min_scale_clamp_steps_at_the_floor_with_clamped_gradients(fused):
    """Above the floor an overflow still skips and backs off; at the floor, once `max_consecutive_skips`
    skips ran in a row, the step is taken, NaN elements as 0 and inf as 65504 / scale. Bugs caught:
    stepping with inf (weights become inf), clamping above the floor (hiding overflows the backoff
    would fix), or at the first overflow at the floor (the docs say after max_consecutive_skips)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = (
        torch.optim.SGD(model.parameters(), lr=1e-6)
        if not fused
        else torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    )
    scaler = DynamicLossScaler(init_scale=2.0, min_scale=1.0, at_min_scale="clamp", max_consecutive_skips=2)
    w = model.weight.detach().clone()
    _step(scaler, model, opt, grad_inf=True)  # 2 -> 1: skipped
    assert torch.equal(model.weight, w) and scaler.get_scale() == 1.0 and scaler.clamped_steps == 0
    _step(scaler, model, opt, grad_inf=True)  # at the floor, one skip in a row: still skipped
    assert torch.equal(model.weight, w) and scaler.clamped_steps == 0
    _step(scaler, model, opt, grad_inf=True)  # at the floor after two: stepped, clamped
    assert (
        scaler.clamped_steps == 1 and torch.isfinite(model.weight).all() and not torch.equal(model.weight, w)
    )
    assert scaler.stats()["skipped_steps"] == 2


def test_at_min_scale_clamp_never_steps_a_nonfinite_loss_and_keeps_the_users_clip():
    """Bugs caught: clamping stepped on an all-NaN gradient from a non-finite loss (all zeros: AdamW's
    decay and moments still moved the weights); and it ran after the user's `clip_grad_norm_` (which
    saw inf), so the update had norm 6550 with `max_norm=1`."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = DynamicLossScaler(init_scale=1.0, min_scale=1.0, at_min_scale="clamp", max_consecutive_skips=1)
    x = torch.randn(3, 4)

    def step(loss_factor=1.0, grad_inf=False, clip=None):
        opt.zero_grad()
        scaler.scale(model(x).pow(2).mean() * loss_factor).backward()
        if grad_inf:
            model.weight.grad[0, 0] = float("inf")
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        return torch.cat(
            [(p.detach() - b).flatten() for p, b in zip(model.parameters(), before, strict=True)]
        )

    assert step(grad_inf=True).abs().max() == 0  # the first skip in a row: skipped
    assert step(loss_factor=float("nan")).abs().max() == 0  # a non-finite loss: never clamped
    assert scaler.clamped_steps == 0
    update = step(grad_inf=True, clip=1.0)  # clamped, then the user's clip: lr 1 x norm <= 1
    assert scaler.clamped_steps == 1 and 0 < update.norm() <= 1.0 + 1e-5


def test_floor_event_after_n_steps_at_min_scale():
    """Bug caught: no word when the scale sits at its floor (pytorch #99640), or one every step."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=1.0, min_scale=1.0, floor_event_steps=3)
    with pytest.warns(UserWarning, match="sat at its floor"):
        for _ in range(6):
            _step(scaler, model, opt)
    assert [e["event"] for e in scaler.drain_events()] == ["floor"]


# ---------------------------------------------------------------------- naming the origin
def test_forward_origin_is_the_overflowing_module_not_the_first_parameters():
    """Bug caught: the first module in parameter order (the embeddings) or a parent named instead
    of the deepest module whose output overflows with finite inputs."""
    model, _ = overflowing_bert()
    found = find_overflow_origin(model, [batch()], loss_fn, context=fp16_emulation)
    assert found["kind"] == "forward" and found["origin"] == QUERY and found["module_type"] == "Linear"
    assert found["loss_finite"] is False


def test_no_origin_for_a_model_that_does_not_overflow():
    _, plain = overflowing_bert()
    assert find_overflow_origin(plain, [batch()], loss_fn, context=fp16_emulation) is None


def test_backward_origin_at_a_scale_too_high():
    """At 2^40 the classifier head's input gradient overflows while its output gradient still fits;
    at 2^10 nothing overflows. Bug caught: a backward overflow called forward, or a replay that
    ignores the step's scale."""
    _, plain = overflowing_bert()
    found = find_overflow_origin(plain, [batch()], loss_fn, context=fp16_emulation, scale=2.0**40)
    assert found["kind"] == "backward" and found["loss_finite"] and found["scale"] == 2.0**40
    assert found["origin"] in dict(plain.named_modules())
    assert find_overflow_origin(plain, [batch()], loss_fn, context=fp16_emulation, scale=2.0**10) is None


def test_replay_leaves_rng_buffers_and_grads_alone():
    """Bug caught: the diagnosis drawing dropout masks from training's RNG (changing the run), or
    writing `.grad`."""
    model, _ = overflowing_bert()
    model.train()
    state = torch.get_rng_state()
    find_overflow_origin(model, [batch()], loss_fn, context=fp16_emulation, scale=2.0**40)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------------- modules in FP32
def test_fp32_module_makes_the_emulated_forward_finite_and_leaves_fp32_bitwise():
    """Bug caught: the emulation ignoring the region (still inf), or the wrapper changing the FP32
    function. (Training mode: with attention dropout the inf reaches the loss.)"""
    model, _ = overflowing_bert()
    b = batch()

    def logits(fp16: bool, train: bool):
        model.train(train)
        torch.manual_seed(0)
        with torch.no_grad(), fp16_emulation() if fp16 else contextlib.nullcontext():
            return model(**b).logits

    fp32_before = logits(False, False)
    assert not torch.isfinite(logits(True, True)).all()
    assert run_in_fp32(model, ["layer.1.attention.self"]) == ["bert.encoder.layer.1.attention.self"]
    assert torch.equal(logits(False, False), fp32_before)
    assert torch.isfinite(logits(True, True)).all()


def test_fp32_module_runs_outside_real_autocast():
    """Under real CPU autocast the wrapped module's output is FP32, its neighbours' half. Bug caught:
    autocast left on inside the region."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    run_in_fp32(model, ["1"])
    seen = {}

    def record(name):
        def hook(module, args, output):
            seen[name] = output.dtype

        return hook

    for name in ("0", "1"):
        model.get_submodule(name).register_forward_hook(record(name))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 4))
    assert seen == {"0": torch.bfloat16, "1": torch.float32}


def test_patterns_match_names_suffixes_runs_and_globs():
    model = tiny_bert_classifier()
    hits = modules_matching(model, ["query", "layer.0.attention", "*.layer.1.output", "nothing_here"])
    assert hits["query"] == [f"bert.encoder.layer.{i}.attention.self.query" for i in (0, 1)]
    assert hits["layer.0.attention"] == ["bert.encoder.layer.0.attention"]
    assert hits["*.layer.1.output"] == ["bert.encoder.layer.1.output"]
    assert hits["nothing_here"] == []
    with pytest.raises(ValueError, match=r"\['nothing_here'\] match no module"):
        run_in_fp32(model, ["nothing_here"])


def test_models_own_keep_in_fp32_modules_join():
    """Bug caught: `_keep_in_fp32_modules` ignored (transformers keeps those weights in FP32 but
    autocast would still run them in FP16)."""
    model = tiny_bert_classifier()
    model._keep_in_fp32_modules = ["classifier"]
    assert run_in_fp32(model, []) == ["classifier"]
    assert fp32_module_names(model) == ["classifier"]
    unwrap(model.classifier)
    assert fp32_module_names(model) == []


def test_config_fp32_modules_from_strings_env_and_files(tmp_path):
    from hf_lossscale.core.config import resolve_config

    assert LossScaleConfig(fp32_modules="auto, a.b ,").fp32_modules == ("auto", "a.b")
    assert LossScaleConfig(fp32_modules=["x"]).fp32_patterns == ("x",)
    config = resolve_config(environ={"HF_LOSSSCALE_FP32_MODULES": "auto,query"})
    assert config.auto_fp32 and config.fp32_patterns == ("query",)
    path = tmp_path / "c.yaml"
    config.to_file(path)
    assert LossScaleConfig.from_file(path) == config
    with pytest.raises(ValueError, match="fp32_modules"):
        LossScaleConfig(fp32_modules=[1])
    with pytest.raises(ValueError, match="at_min_scale"):
        LossScaleConfig(at_min_scale="ignore")


def test_state_keeps_auto_modules_and_refuses_a_bad_list():
    scaler = DynamicLossScaler()
    scaler.scale(torch.ones(()))
    scaler.state.fp32_modules.append("a.b")
    other = DynamicLossScaler()
    other.load_state_dict(scaler.state_dict())
    assert other.state.fp32_modules == ["a.b"]
    bad = {**scaler.state_dict(), "fp32_modules": "a.b"}
    with pytest.raises(ValueError, match="fp32_modules"):
        other.load_state_dict(bad)


# ---------------------------------------------------------------------- pre-flight
def test_preflight_finds_the_modules_auto_would_and_leaves_the_model_alone():
    """Bug caught: the pre-flight missing an overflow that only the FP16 replay shows (the attention
    matmul after the query moves), or leaving its trial wrappers on the model."""
    model, _ = overflowing_bert()
    result = preflight(model, [batch()], loss_fn)
    assert result["modules"][QUERY]["status"] == "overflows"
    assert result["modules"][QUERY]["act_margin_bits"] < 0
    assert [o["origin"] for o in result["overflow_in_fp16"]] == [QUERY, "bert.encoder.layer.1.attention.self"]
    assert result["suggested_fp32_modules"] == [
        "bert.encoder.layer.1.attention.self"
    ]  # the query lies inside
    assert fp32_module_names(model) == []
    assert QUERY in format_preflight(result)
    _, plain = overflowing_bert()
    clean = preflight(plain, [batch()], loss_fn)
    assert clean["suggested_fp32_modules"] == [] and all(
        m["status"] == "ok" for m in clean["modules"].values()
    )
    assert 1.0 <= clean["suggested_init_scale"] <= 2.0**24


# ---------------------------------------------------------------------- the Trainer
def _train(tmp_path, model, max_steps=6, **args):
    from hf_lossscale import LossScaleTrainer, LossScaleTrainingArguments
    from hf_lossscale.core.events import read_events

    targs = LossScaleTrainingArguments(
        str(tmp_path), fp16=True, max_steps=max_steps, per_device_train_batch_size=8, learning_rate=1e-3,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, **args,
    )  # fmt: skip
    trainer = LossScaleTrainer(model=model, args=targs, train_dataset=tiny_classification_dataset())
    error = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer.train()
        except LossScaleCollapseError as err:
            error = err
    return trainer, read_events(tmp_path / "loss_scale_log.jsonl"), error


def test_trainer_forward_overflow_without_remedy(tmp_path):
    """Every step skipped, the scale left at 2^16, overflow events naming the query as a forward
    origin, and the collapse error leading with it."""
    model, _ = overflowing_bert()
    trainer, events, error = _train(tmp_path, model, loss_scale_max_consecutive_skips=4)
    overflows = [e for e in events if e["event"] == "overflow"]
    assert overflows and all(e["kind"] == "forward" and e["origin"] == QUERY for e in overflows)
    assert all(e["loss_nonfinite"] for e in overflows)
    assert isinstance(error, LossScaleCollapseError) and error.origin == QUERY
    assert str(error).startswith(f"Forward overflow in `{QUERY}`")
    stats = trainer.loss_scaler.stats()
    assert stats["loss_scale"] == 2.0**16 and stats["nonfinite_loss_steps"] == stats["skipped_steps"] == 4


def test_trainer_auto_moves_the_origin_to_fp32_trains_and_resumes(tmp_path):
    """Bug caught: "auto" not acting (every step skipped), moving a module that did not overflow,
    or a resume that forgets what it moved."""
    model, _ = overflowing_bert()
    trainer, events, error = _train(tmp_path, model, max_steps=8, loss_scale_fp32_modules="auto")
    assert error is None
    added = [e["module"] for e in events if e["event"] == "fp32_module_added"]
    assert added == [QUERY, "bert.encoder.layer.1.attention.self"]
    stats = trainer.loss_scaler.stats()
    assert stats["skipped_steps"] == 2 and stats["loss_scale"] == 2.0**16
    losses = [e["loss"] for e in events if e["event"] == "log" and "loss" in e]
    assert all(torch.isfinite(torch.tensor(v)) for v in losses[2:])
    state = trainer.loss_scaler.state_dict()
    assert state["fp32_modules"] == added
    # a resume: a fresh model and scaler, the state loaded
    fresh, _ = overflowing_bert()
    resumed = DynamicLossScaler()
    resumed.load_state_dict(state)
    run_in_fp32(fresh, resumed.state.fp32_modules, include_model_own=False)
    assert fp32_module_names(fresh) == ["bert.encoder.layer.1.attention.self"]  # the query lies inside


def test_trainer_auto_cap_names_the_module_it_refuses(tmp_path):
    model, _ = overflowing_bert()
    _, events, _ = _train(tmp_path, model, max_steps=4, loss_scale_fp32_modules="auto",
                          loss_scale_max_auto_fp32_modules=1, loss_scale_max_consecutive_skips=0)  # fmt: skip
    refused = [e for e in events if e["event"] == "fp32_module_refused"]
    assert refused and refused[0]["module"] == "bert.encoder.layer.1.attention.self"
    assert "max_auto_fp32_modules=1" in refused[0]["reason"]


def test_trainer_auto_leaves_a_healthy_model_bitwise_alone(tmp_path):
    """A model that never overflows trains to the same losses, bitwise, with and without "auto"."""
    _, plain_a = overflowing_bert()
    _, plain_b = overflowing_bert()
    _, with_auto, _ = _train(tmp_path / "a", plain_a, loss_scale_fp32_modules="auto")
    _, without, _ = _train(tmp_path / "b", plain_b)
    losses = [[e["loss"] for e in ev if e["event"] == "log" and "loss" in e] for ev in (with_auto, without)]
    assert losses[0] == losses[1] and len(losses[0]) == 6
    assert not any(e["event"].startswith("fp32_module") for e in with_auto)
    assert next(e for e in with_auto if e["event"] == "run_start")["fp32_modules"] == []


def test_trainer_configured_fp32_modules_and_preflight_flag(tmp_path):
    """Configured patterns apply from the first step (no skip); the pre-flight flag runs before the
    first step and records what it found."""
    model, _ = overflowing_bert()
    trainer, events, error = _train(
        tmp_path,
        model,
        max_steps=3,
        loss_scale_fp32_modules="layer.1.attention.self",
        loss_scale_preflight=True,
    )
    assert error is None and trainer.loss_scaler.stats()["skipped_steps"] == 0
    assert next(e for e in events if e["event"] == "run_start")["fp32_modules"] == [
        "bert.encoder.layer.1.attention.self"
    ]
    flight = [e for e in events if e["event"] == "preflight"]
    assert flight and flight[0]["step"] == 0
    assert flight[0]["overflowing_modules"] == [QUERY]  # FP32 activations above 65504 ...
    assert flight[0]["suggested_fp32_modules"] == []  # ... but already in FP32: nothing left to move


def test_trainer_preflight_warns_with_the_table(tmp_path):
    model, _ = overflowing_bert()
    from hf_lossscale import LossScaleTrainer, LossScaleTrainingArguments

    targs = LossScaleTrainingArguments(
        str(tmp_path), fp16=True, max_steps=1, per_device_train_batch_size=8, report_to=[], save_strategy="no",
        disable_tqdm=True, loss_scale_preflight=True, loss_scale_fp32_modules="auto",
    )  # fmt: skip
    trainer = LossScaleTrainer(model=model, args=targs, train_dataset=tiny_classification_dataset())
    with pytest.warns(UserWarning, match=r"pre-flight(.|\n)*Suggested fp32_modules: \['bert"):
        trainer.train()


def test_preflight_command_on_a_saved_checkpoint(tmp_path, capsys):
    """`hf-lossscale preflight`: the table on stdout, the JSON, and exit status 2 when FP16 would
    overflow (0 when not). Bug caught: the command wired to the wrong objective or ignoring the file."""
    import json

    from tiny_models import save_tiny_bert
    from transformers import BertForMaskedLM

    from hf_lossscale.tools.cli import main

    save_tiny_bert(tmp_path / "plain")
    model = BertForMaskedLM.from_pretrained(tmp_path / "plain")
    _bench().rescale_attention(model, 0, 20)
    model.save_pretrained(tmp_path / "hot")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (tmp_path / "plain" / name).exists():
            (tmp_path / "hot" / name).write_bytes((tmp_path / "plain" / name).read_bytes())
    text = tmp_path / "train.txt"
    text.write_text(
        "\n".join(f"the quick brown fox {i} jumps over the lazy dog again and again" for i in range(200))
    )
    common = ["--objective", "mlm", "--train_file", str(text), "--block_size", "16", "--steps", "1"]
    out = tmp_path / "p.json"
    assert (
        main(["preflight", "--model_name_or_path", str(tmp_path / "hot"), *common, "--output_json", str(out)])
        == 2
    )
    printed = capsys.readouterr().out
    assert "bert.encoder.layer.0.attention.self.query" in printed and "overflows" in printed
    assert json.loads(out.read_text())["suggested_fp32_modules"] == ["bert.encoder.layer.0.attention.self"]
    assert main(["preflight", "--model_name_or_path", str(tmp_path / "plain"), *common]) == 0


def test_transient_overflow_is_reported_as_not_reproduced_and_replays_are_not_kept(tmp_path):
    """A gradient overflow the replay cannot reproduce (one bad step, gone in the replay): the event
    says so and training goes on. Bug caught: the replay's own forwards captured as batches of the
    step, so a replay that finds nothing replays the batches it just added, forever."""
    from hf_lossscale import LossScaleTrainer, LossScaleTrainingArguments
    from hf_lossscale.core.events import read_events
    from hf_lossscale.integrations.callbacks import OverflowDiagnosisCallback

    class Transient(LossScaleTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.state.global_step == 1:  # the second optimizer step's micro-batches only
                model.classifier.weight.grad.fill_(float("inf"))
            return loss

    _, plain = overflowing_bert()
    targs = LossScaleTrainingArguments(
        str(tmp_path), fp16=True, max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1,
    )  # fmt: skip
    trainer = Transient(model=plain, args=targs, train_dataset=tiny_classification_dataset())
    diagnosis = next(
        c for c in trainer.callback_handler.callbacks if isinstance(c, OverflowDiagnosisCallback)
    )
    seen = []
    original = diagnosis._diagnose

    def counting(model, scaler):
        seen.append(len(diagnosis._batches))
        found = original(model, scaler)
        seen.append(len(diagnosis._batches))
        return found

    diagnosis._diagnose = counting
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert seen == [2, 2]  # the step's two micro-batches, before and after the replay
    overflow = [e for e in read_events(tmp_path / "loss_scale_log.jsonl") if e["event"] == "overflow"]
    assert (
        len(overflow) == 1 and overflow[0]["origin"] is None and "not reproduced" in overflow[0]["diagnosis"]
    )
    assert trainer.loss_scaler.stats()["total_steps"] == 3


def test_replay_draws_the_training_steps_dropout_masks():
    """Bug caught: a replay that draws other dropout masks, so an overflow that depends on the mask
    (the transient backward overflows of forward_overflow.py's runs) is called "not reproduced"."""
    from hf_lossscale.core.overflow import rng_state

    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, 1)).train()
    seen = []
    model[1].register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    x = torch.randn(4, 8)
    state = rng_state(model)
    model(x).sum().backward()  # the training step
    after_training = torch.get_rng_state()
    find_overflow_origin(model, [x], lambda m, b: m(b).sum(), scale=1.0, rng_states=[state])
    assert len(seen) == 2 and torch.equal(seen[1], seen[0])  # one replayed forward, the same mask
    assert torch.equal(torch.get_rng_state(), after_training)  # training's stream untouched
    find_overflow_origin(model, [x], lambda m, b: m(b).sum(), scale=1.0)
    assert not torch.equal(seen[-1], seen[0])  # without the state: other masks


def test_trainer_resume_keeps_the_modules_auto_moved(tmp_path):
    """Through the Trainer's own checkpoint: a run resumed from it runs the modules "auto" moved in FP32
    from its first step (no skip, no new move). Bug caught: the scaler state's `fp32_modules` saved but
    not re-applied on resume, so every resume pays the forward overflows again."""
    from hf_lossscale import LossScaleTrainer, LossScaleTrainingArguments
    from hf_lossscale.core.events import read_events

    def trainer_for(max_steps):
        model, _ = overflowing_bert()
        targs = LossScaleTrainingArguments(
            str(tmp_path), fp16=True, max_steps=max_steps, per_device_train_batch_size=8, learning_rate=1e-3,
            logging_steps=1, report_to=[], save_strategy="steps", save_steps=4, disable_tqdm=True,
            loss_scale_fp32_modules="auto",
        )  # fmt: skip
        return LossScaleTrainer(model=model, args=targs, train_dataset=tiny_classification_dataset())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer_for(4).train()
        resumed = trainer_for(6)
        resumed.train(resume_from_checkpoint=True)
    assert fp32_module_names(resumed.model) == ["bert.encoder.layer.1.attention.self"]
    events = read_events(tmp_path / "loss_scale_log.jsonl")
    start = max(i for i, e in enumerate(events) if e["event"] == "run_start")
    after = events[start:]
    assert after[0]["resumed"] and after[0]["fp32_modules"] == ["bert.encoder.layer.1.attention.self"]
    assert not [e for e in after if e["event"] in ("overflow", "fp32_module_added")]
    assert resumed.loss_scaler.stats()["skipped_steps"] == 2  # the first run's two, none after


def test_a_replay_that_fails_says_so_keeps_its_budget_and_replays_at_the_steps_own_scale(
    tmp_path, monkeypatch
):
    """A backward overflow at the floor (scale 1 = min_scale: the backoff's clamp leaves it at 1), whose
    replay raises (as reentrant gradient checkpointing does). Bugs caught: reported as "not reproduced
    (transient)" with the one backward replay spent; and the replay run at twice the step's scale
    (rebuilt from the scale after the update as if the backoff had halved it)."""
    from hf_lossscale import LossScaleTrainer, LossScaleTrainingArguments
    from hf_lossscale.core.events import read_events
    from hf_lossscale.integrations import callbacks

    class Overflowing(LossScaleTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.state.global_step == 1:
                model.classifier.weight.grad.fill_(float("inf"))
            return loss

    scales = []

    def failing_replay(model, batches, loss_fn, *, context, scale, rng_states):
        scales.append(scale)
        raise RuntimeError("checkpointing is not compatible with .grad()")

    monkeypatch.setattr(callbacks, "find_overflow_origin", failing_replay)
    _, plain = overflowing_bert()
    targs = LossScaleTrainingArguments(
        str(tmp_path), fp16=True, max_steps=3, per_device_train_batch_size=4, report_to=[], save_strategy="no",
        disable_tqdm=True, logging_steps=1, loss_scale_init=1.0, loss_scale_min=1.0,
    )  # fmt: skip
    trainer = Overflowing(model=plain, args=targs, train_dataset=tiny_classification_dataset())
    diagnosis = next(
        c for c in trainer.callback_handler.callbacks if isinstance(c, callbacks.OverflowDiagnosisCallback)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    overflow = [e for e in read_events(tmp_path / "loss_scale_log.jsonl") if e["event"] == "overflow"]
    assert len(overflow) == 1 and overflow[0]["diagnosis"].startswith(
        "replay failed: RuntimeError: checkpointing"
    )
    assert diagnosis.backward_replays == 0  # the budget is kept for a replay that can run
    assert scales == [1.0]  # the step ran at 1 (the floor), not 2


def test_preflight_prints_its_verdict_when_the_model_is_clean():
    """Issue 48: the pre-flight table ends in a verdict, also when nothing is wrong (it printed only the
    facts, and a clean model's reader had to infer that it was clean)."""
    from hf_lossscale.fp16.preflight import format_preflight

    module = {"type": "Linear", "act_max": 3.0, "act_margin_bits": 14.4, "grad_max": 1e-3, "grad_min": 1e-9,
              "grad_top_margin_bits": 26.0, "grad_bottom_margin_bits": -6.0, "status": "ok"}  # fmt: skip
    result = {"modules": {"fc": module}, "suggested_init_scale": 2.0**16, "overflow_in_fp16": [],
              "overflow_outside_modules": False, "near_bits": 2.0, "suggested_fp32_modules": [],
              "grad_max": 1e-3, "margin_bits": 3}  # fmt: skip
    assert "**Verdict: clean: FP16 runs this model as it is; start the scale at 2^16.**" in format_preflight(
        result
    )
    result["modules"]["fc"] = {**module, "status": "overflows", "act_max": 7e4, "act_margin_bits": -0.1}
    assert "**Verdict: FP16 overflows" in format_preflight(result)
