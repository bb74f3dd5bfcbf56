"""Telemetry: histogram buckets against hand-built tensors, no host sync between log steps, the
Trainer's logged figures, the overflow diagnosis, `report` and `advise` end to end."""

import json
import math

import pytest
import torch
from sync_count import count_reads
from tiny_models import save_tiny_bert, tiny_bert_classifier, tiny_classification_dataset

from hf_lossscale import DynamicLossScaler, LossScaleTrainer, LossScaleTrainingArguments
from hf_lossscale.core.events import read_run_events
from hf_lossscale.core.telemetry import (
    BUCKETS,
    ActivationGradientProbe,
    bucket_counts,
    module_key,
    summarize_counts,
)


def oracle_bucket(x: float) -> str:
    """The bucket of one value, from Python's math.frexp (independent of the torch code)."""
    if math.isnan(x) or math.isinf(x):
        return "inf/nan"
    if x == 0:
        return "zero"
    exponent = math.frexp(abs(x))[1] - 1
    if exponent < -24:
        return "<2^-24"
    if exponent > 15:
        return ">=2^16"
    return f"2^{exponent}"


VALUES = [0.0, -0.0, 2.0**-30, 2.0**-24, -(2.0**-24), 1.5 * 2**-20, 2.0**-14 * 0.999, 2.0**-14, 1.0, -3.0,
          65504.0, 65536.0, 1e30, math.inf, -math.inf, math.nan, 2.0**-149]  # fmt: skip


def test_buckets_against_hand_built_values():
    counts = bucket_counts(torch.tensor(VALUES, dtype=torch.float32)).tolist()
    expected = [0] * len(BUCKETS)
    for v in VALUES:
        expected[BUCKETS.index(oracle_bucket(float(torch.tensor(v, dtype=torch.float32))))] += 1
    assert counts == expected
    assert counts[BUCKETS.index("zero")] == 2 and counts[BUCKETS.index("<2^-24")] == 2
    assert counts[BUCKETS.index("2^-24")] == 2 and counts[BUCKETS.index("inf/nan")] == 3
    assert counts[BUCKETS.index("2^15")] == 1 and counts[BUCKETS.index(">=2^16")] == 2


def test_fractions_and_headroom():
    x = torch.tensor([0.0, 0.0, 2.0**-30, 2.0**-20, 2.0**-10, 1.0, 2.0, 2.0**12])
    s = summarize_counts(bucket_counts(x), amax=2.0**12)
    assert s["zero_frac"] == 2 / 8 and s["below_fp16_frac"] == 1 / 8
    assert s["subnormal_frac"] == 2 / 8  # 2^-30 and 2^-20: 0 < |x| < 2^-14
    assert s["headroom_bits"] == pytest.approx(math.log2(65504 / 4096))
    assert summarize_counts(bucket_counts(torch.tensor([1e6])), amax=1e6)["headroom_bits"] < 0


def test_module_keys():
    assert module_key("bert.encoder.layer.3.attention.self.query.weight") == "bert.encoder.layer.3"
    assert module_key("bert.embeddings.word_embeddings.weight") == "bert.embeddings"
    assert module_key("classifier.weight") == "classifier"
    assert module_key("0.weight") == "0"


def tiny_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_scaled_gradients_histogram_and_no_sync_between_reads():
    model = tiny_mlp()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    scaler = DynamicLossScaler(init_scale=2.0**10, telemetry_interval=2)
    scaler.set_parameter_names(model)
    seen = {}

    def iteration(i):
        x = torch.randn(4, 8)
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        if i == 2:  # the scaled gradients the telemetry must see at iteration 2
            seen.update({n: p.grad.clone() for n, p in model.named_parameters()})
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    assert count_reads(lambda: [iteration(i) for i in range(5)]) == 0  # no host sync at all
    snapshot = scaler.telemetry.read()
    assert snapshot["step"] == 4  # iterations 0, 2, 4 observed; the last one is returned
    seen.clear()
    scaler = DynamicLossScaler(init_scale=2.0**10, telemetry_interval=1)  # `iteration` uses this one now
    scaler.set_parameter_names(model)
    iteration(2)
    snapshot = scaler.telemetry.read()
    expected = [0] * len(BUCKETS)
    for g in seen.values():
        for v in g.reshape(-1).tolist():
            expected[BUCKETS.index(oracle_bucket(v))] += 1
    assert summarize_counts(expected)["counts"] == [
        sum(col) for col in zip(*(m["counts"] for m in snapshot["per_module"].values()), strict=True)
    ]
    assert set(snapshot["per_module"]) == {"0", "2"}
    amax = max(float(g.abs().max()) for g in seen.values())
    assert snapshot["headroom_bits"] == pytest.approx(math.log2(65504 / amax))
    assert scaler.telemetry.read(only_new=True) is None


def test_activation_probe_sees_fp16_underflow():
    from hf_lossscale import fp16_emulation

    model = tiny_mlp()
    probe = ActivationGradientProbe(model)
    probe.active = True
    with fp16_emulation():
        (model(torch.randn(4, 8)).pow(2).mean() * 1e-9).backward()
    small = probe.read()
    assert set(small["per_module"]) == {"0", "2"} and small["lost_frac"] > 0.5
    with fp16_emulation():
        (model(torch.randn(4, 8)).pow(2).mean() * 2.0**10).backward()
    assert probe.read()["lost_frac"] < small["lost_frac"]
    probe.active = False
    model(torch.randn(4, 8)).sum().backward()
    assert probe.read()["total"] == 0
    probe.remove()


class InjectingTrainer(LossScaleTrainer):
    """inf into one layer's gradient or into the model's loss (via hooks), at chosen steps."""

    grad_steps, loss_steps = (), ()


def run_trainer(tmp_path, **kw):
    args = LossScaleTrainingArguments(
        str(tmp_path / "out"), fp16=True, max_steps=8, logging_steps=2, per_device_train_batch_size=8,
        report_to=[], save_strategy="no", disable_tqdm=True, learning_rate=1e-3, seed=0,
        loss_scale_init=2.0**10, loss_scale_telemetry_interval=2, **kw,
    )  # fmt: skip
    trainer = InjectingTrainer(
        model=tiny_bert_classifier(), args=args, train_dataset=tiny_classification_dataset()
    )
    layer = trainer.model.bert.encoder.layer[1].output.dense.weight
    layer.register_hook(lambda g: g * float("inf") if trainer.state.global_step in trainer.grad_steps else g)

    def poison_loss(module, args, output):  # the model's own loss comes out non-finite
        if trainer.state.global_step in trainer.loss_steps:
            output["loss"] = output["loss"] * float("inf")
        return output

    trainer.model.register_forward_hook(poison_loss)
    trainer.grad_steps, trainer.loss_steps = (3,), (5,)
    trainer.train()
    return trainer, read_run_events(tmp_path / "out" / "loss_scale_log.jsonl")


def test_trainer_logs_telemetry_and_diagnoses_overflows(tmp_path):
    trainer, run = run_trainer(tmp_path, loss_scale_activation_probe=True)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert all(
        {"grad_zero_frac", "grad_subnormal_frac", "headroom_bits", "act_grad_lost_frac"} <= set(e)
        for e in logs
    )
    assert all(0 <= e["grad_zero_frac"] <= 1 and math.isfinite(e["headroom_bits"]) for e in logs)
    telemetry = [e for e in run if e["event"] == "telemetry"]
    assert {e["source"] for e in telemetry} == {"param_grads", "activation_grads"}
    assert "bert.encoder.layer.1" in telemetry[0]["per_module"]
    overflows = [e for e in run if e["event"] == "overflow"]
    assert [e["step"] for e in overflows] == [4, 6]  # optimizer steps 4 and 6 (global_step 3 and 5 before)
    assert overflows[0]["modules"] == ["bert.encoder.layer.1"] and overflows[0]["loss_nonfinite"] is False
    assert overflows[0]["params"] == ["bert.encoder.layer.1.output.dense.weight"]
    assert overflows[1]["loss_nonfinite"] is True and len(overflows[1]["modules"]) > 3


def test_report_end_to_end(tmp_path):
    from hf_lossscale.tools.cli import main

    run_trainer(tmp_path)
    assert main(["report", str(tmp_path / "out")]) == 0
    out = tmp_path / "out" / "report"
    for name in ("scale_and_loss.png", "grad_exponents.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    text = (out / "report.md").read_text()
    assert "8 optimizer steps, 2 skipped" in text
    # the injected inf in a weight's gradient: a backward overflow, named where it starts
    assert (
        "step 4: backward overflow starting in `bert.encoder.layer.1.output.dense`; non-finite gradients in "
        "bert.encoder.layer.1" in text
    )
    assert "| bert.encoder.layer.1 |" in text
    # the poisoned loss (computed in the model's own forward): a forward overflow there
    assert "step 6: forward overflow starting in the model's own forward" in text
    with pytest.raises(FileNotFoundError, match="No loss_scale_log.jsonl"):
        main(["report", str(tmp_path)])


def test_advise_end_to_end_on_a_local_model(tmp_path, capsys):
    from hf_lossscale.tools.cli import main

    model = save_tiny_bert(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text(
        "\n".join(
            f"line {i} of a small local corpus about loss scaling in half precision" for i in range(200)
        )
    )
    result_file = tmp_path / "advice.json"
    argv = ["advise", "--model_name_or_path", model, "--train_file", str(text), "--objective", "clm",
            "--block_size", "32", "--steps", "2", "--output_json", str(result_file)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(result_file.read_text())
    scale = result["recommended_scale"]
    assert math.log2(scale).is_integer() and 1 <= scale <= 2**24
    biggest = max(result["activation_grad_max_abs"], result["param_grad_max_abs"])
    assert (
        biggest * scale <= 65504 / 2**3 < biggest * scale * 2
    )  # the largest power of two with a 3-bit margin
    assert result["lost_at_recommended"] <= result["lost_at_1"]
    assert f"--loss_scale_init {scale:g}" in capsys.readouterr().out


def test_buckets_of_every_bit_pattern_match_the_exponent_field():
    """Random 32-bit patterns (every sign, exponent, subnormal, inf and NaN), non-contiguous and of
    odd length: the counts equal a histogram of the IEEE exponent field read with integer shifts.
    Bug caught: the byte-level exponent read (CPU) taking the wrong byte or losing the exponent's
    lowest bit, which would move every value to a neighbouring bucket."""
    from hf_lossscale.core.telemetry import _BELOW, _ZERO, _fold_table

    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (200_003,), dtype=torch.int64, generator=g).to(torch.int32)
    bits[:100] = 0  # zeros
    values = bits.view(torch.float32)[::2]  # strided
    biased = (values.contiguous().view(torch.int32) >> 23) & 0xFF
    expected = torch.zeros(len(BUCKETS), dtype=torch.int64).index_add_(
        0, _fold_table(biased.device), torch.bincount(biased.long(), minlength=256)
    )
    zeros = int((values == 0).sum())
    got = bucket_counts(values)
    assert got[_ZERO] == zeros and got[_BELOW] == int(expected[_BELOW]) - zeros
    got[_ZERO], got[_BELOW] = 0, int(expected[_BELOW])
    assert torch.equal(got, expected)


def test_untouched_rows_are_told_from_zeros_in_touched_rows():
    """An embedding's rows of tokens not in the batch are zero throughout; a zero among nonzero
    values (what underflow leaves) is another thing. Bug caught (issue 48): one `zero_frac` of 0.52
    on a healthy run, all of it untouched embedding rows."""
    from hf_lossscale.core.telemetry import GradientTelemetry, untouched_elements

    emb = torch.zeros(10, 4)
    emb[2] = torch.tensor([1.0, 0.0, 2.0, 3.0])  # a touched row with one zero in it
    emb[5] = 1.0
    bias = torch.tensor([0.0, 1.0])  # 1-D: one row, touched; its zero is a touched zero
    unused = torch.zeros(3)  # a parameter the forward did not use
    assert int(untouched_elements(emb)) == 8 * 4 and int(untouched_elements(bias)) == 0
    assert int(untouched_elements(unused)) == 3
    telemetry = GradientTelemetry(interval=1)
    telemetry.observe([("emb.weight", emb), ("emb.bias", bias), ("head.unused", unused)], iteration=0)
    telemetry.end_iteration(0)
    s = telemetry.read()
    total = 40 + 2 + 3
    assert s["zero_frac"] == (32 + 1 + 1 + 3) / total  # every zero, as before
    assert s["untouched_frac"] == (32 + 3) / total
    assert s["touched_zero_frac"] == 2 / total
    assert s["per_module"]["emb"]["untouched_frac"] == 32 / 42
    assert s["per_module"]["head"]["touched_zero_frac"] == 0.0
