"""The run-watching `TrainerCallback`s: on a plain `Trainer`, and where the mixin's runs need them."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_bert_classifier, tiny_classification_dataset
from transformers import Trainer, TrainingArguments

from hf_lossscale import LossScaleTrainer, LossScaleTrainingArguments, install_loss_scaler
from hf_lossscale.core.events import read_events, read_run_events
from hf_lossscale.fp16.emulation import measure_flushed_fraction
from hf_lossscale.integrations.callbacks import (
    FlushedFractionCallback,
    LossScaleEventLogCallback,
    OverflowDiagnosisCallback,
)


def plain_trainer(tmp_path, **kw):
    args = TrainingArguments(
        str(tmp_path / "out"), max_steps=4, logging_steps=2, per_device_train_batch_size=8, report_to=[],
        save_strategy="no", disable_tqdm=True, learning_rate=1e-3, seed=0, **kw,
    )  # fmt: skip
    return Trainer(model=tiny_bert_classifier(), args=args, train_dataset=tiny_classification_dataset())


def test_event_log_on_a_plain_trainer(tmp_path):
    """The event log reads only the Trainer's public attributes. Catches a callback that needs the
    mixin (an AttributeError on a plain Trainer) or loses the log events' fields."""
    trainer = plain_trainer(tmp_path)
    events = LossScaleEventLogCallback(trainer)
    trainer.add_callback(events)
    trainer.add_callback(OverflowDiagnosisCallback(trainer, events))
    trainer.train()
    run = read_run_events(tmp_path / "out" / "loss_scale_log.jsonl")
    assert [e["event"] for e in run] == ["run_start", "log", "log", "log", "run_end"]
    assert run[0]["mixed_precision"] == "no" and run[0]["loss_scale_config"] is None
    assert [e.get("step") for e in run[1:3]] == [2, 4] and "loss" in run[1]
    assert "loss_scale" not in run[-1]  # no DynamicLossScaler: no scaler stats


def test_overflow_diagnosis_on_a_plain_trainer_with_our_scaler(tmp_path):
    """A plain Trainer whose Accelerator got `install_loss_scaler` by hand: an inf gradient at one
    step is diagnosed with its parameter, the loss flagged finite. Catches a diagnosis that fires
    on clean steps, or misses the skip when the scaler is not the mixin's."""
    trainer = plain_trainer(tmp_path, fp16=True)
    install_loss_scaler(trainer.accelerator, overrides={"init_scale": 2.0**10})
    events = LossScaleEventLogCallback(trainer)
    trainer.add_callback(events)
    diagnosis = OverflowDiagnosisCallback(trainer, events)
    trainer.add_callback(diagnosis)
    weight = trainer.model.classifier.weight
    weight.register_hook(lambda g: g * float("inf") if trainer.state.global_step == 2 else g)
    trainer.train()
    run = read_run_events(tmp_path / "out" / "loss_scale_log.jsonl")
    overflows = [e for e in run if e["event"] == "overflow"]
    assert [e["step"] for e in overflows] == [3] and diagnosis.diagnosed == 1
    assert overflows[0]["params"] == ["classifier.weight"] and overflows[0]["loss_nonfinite"] is False
    assert run[-1]["skipped_steps"] == 1
    # one sink: the diagnosis reads back what the file got, and the sink kept no log lines
    assert diagnosis.sink is events.sink and diagnosis.events == overflows
    assert [e["event"] for e in events.sink.events] == ["overflow", "run_end"]


def test_error_before_training_begins_follows_a_run_start(tmp_path):
    """A resume refused before `on_train_begin` (no scaler state in the checkpoint) is still written
    after a `run_start` of its own, so readers attribute it to this run and not the last one.
    Catches `record_error` writing the error without a start."""
    kw = dict(
        output_dir=str(tmp_path / "out"), fp16=True, max_steps=2, per_device_train_batch_size=8, report_to=[],
        save_strategy="steps", save_steps=2, disable_tqdm=True, seed=0,
    )  # fmt: skip
    LossScaleTrainer(
        model=tiny_bert_classifier(),
        args=LossScaleTrainingArguments(**kw),
        train_dataset=tiny_classification_dataset(),
    ).train()
    (tmp_path / "out" / "checkpoint-2" / "scaler.pt").unlink()
    kw.update(max_steps=4, save_strategy="no")
    trainer = LossScaleTrainer(
        model=tiny_bert_classifier(),
        args=LossScaleTrainingArguments(**kw),
        train_dataset=tiny_classification_dataset(),
    )
    with pytest.raises(RuntimeError, match="holds no loss-scaler state"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    last = read_events(tmp_path / "out" / "loss_scale_log.jsonl")[-2:]
    assert [e["event"] for e in last] == ["run_start", "error"]
    assert last[0]["resumed"] is True and last[1]["type"] == "RuntimeError"


def test_flushed_probe_measures_the_first_batch_at_the_initial_weights(tmp_path):
    """The start probe equals `measure_flushed_fraction` on the batch the model received first, at
    the weights before any step and the loss divided by the accumulation steps. Catches a probe
    run at other weights, on another batch, or without the accumulation divisor."""
    batches = []
    trainer = LossScaleTrainer(
        model=tiny_bert_classifier(),
        args=LossScaleTrainingArguments(
            str(tmp_path / "out"),
            fp16=True,
            max_steps=2,
            gradient_accumulation_steps=2,
            per_device_train_batch_size=8,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
            learning_rate=1e-2,
            loss_scale_init=1.0,
            loss_scale_measure_flushed=True,
        ),  # fmt: skip
        train_dataset=tiny_classification_dataset(),
    )
    initial = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.model.register_forward_pre_hook(
        lambda m, a, kw: batches.append({k: v.clone() for k, v in kw.items()}) if m.training else None,
        with_kwargs=True,
    )
    trainer.train()
    probe = next(c for c in trainer.callback_handler.callbacks if isinstance(c, FlushedFractionCallback))
    start = probe.results[0]
    assert start["when"] == "start" and start["step"] == 0 and start["loss_divisor"] == 2
    reference = tiny_bert_classifier()
    reference.load_state_dict(initial)
    expected = measure_flushed_fraction(reference, batches[0], fp16="emulate", scale=1.0, loss_divisor=2)
    assert start["flushed_fraction"] == expected["flushed_fraction"] > 0
    assert start["relative_grad_error"] == pytest.approx(expected["relative_grad_error"], rel=1e-6)
    assert [r["when"] for r in probe.results] == ["start", "end"]
    assert not torch.equal(trainer.model.classifier.weight, initial["classifier.weight"])  # it trained


def test_event_log_survives_a_crash_mid_write_and_bad_lines(tmp_path, capsys):
    """Issue 30: a resumed run's first line is not glued onto a cut one, and the readers skip (and
    count) blank, binary, non-object and field-less lines instead of stopping with a traceback. Bugs
    caught: "line N is not JSON" from `report`, a KeyError on an event without `step`."""
    import json

    from hf_lossscale.core.events import append_event, read_events_counted, read_run_events
    from hf_lossscale.tools.cli import main

    run = tmp_path / "run"
    run.mkdir()
    log = run / "loss_scale_log.jsonl"
    good = [
        {"event": "run_start", "resumed": False},
        {"event": "log", "step": 1, "loss": 2.0, "loss_scale": 1024.0, "skipped_steps": 0},
    ]
    log.write_text("".join(json.dumps(e) + "\n" for e in good) + '{"event": "log", "step": 2, "lo')  # cut
    append_event(log, {"event": "log", "step": 2, "loss": 1.5, "loss_scale": 1024.0, "skipped_steps": 0})
    with open(log, "ab") as f:
        f.write(b"\n")  # blank
        f.write(b"[1, 2]\n")  # not an object
        f.write(b'{"event": "log", "loss": 9.0}\n')  # no step
        f.write(b'{"event": "telemetry", "step": 3}\n')  # no counts
        f.write(b"\xff\xfe\x00binary\n")  # not UTF-8
    append_event(log, {"event": "log", "step": 3, "loss": 1.0, "loss_scale": 1024.0, "skipped_steps": 0})
    events, skipped = read_events_counted(log)
    assert [e.get("step") for e in events if e["event"] == "log"] == [1, 2, 3]
    assert skipped == 6  # the cut line and the five bad ones
    assert len(read_run_events(log)) == 4
    assert main(["report", str(run)]) == 0
    assert "Skipped 6 unreadable line(s)" in capsys.readouterr().out
    assert "**6 unreadable line(s)" in (run / "report" / "report.md").read_text()
    (run / "loss_scale_log.jsonl").write_bytes(bytes(range(256)) * 4)  # a binary file: nothing readable
    assert read_events_counted(log) == ([], 4)


def test_one_event_sink_for_the_callbacks_and_the_scalers_observers():
    """Every event passes through one `EventSink`: a callback's events reach the file's subscriber
    and its own read-back attribute; an observer of the scaler reports through `drain_events`,
    part of the observer interface. Bugs caught: a callback keeping a private list the file never
    sees (or the reverse), a sink keeping `keep=False` lines (a long run's memory), `drain()`
    handing an event out twice, and a custom observer's events lost because only the built-in
    skip watch was drained."""
    from hf_lossscale import DynamicLossScaler
    from hf_lossscale.core.events import EventSink
    from hf_lossscale.core.scaler_observers import ScalerObserver

    class FakeTrainer:
        args = TrainingArguments("unused", report_to=[])

    log = LossScaleEventLogCallback(FakeTrainer(), enabled=False)
    written = []
    log.sink.subscribe(written.append)
    probe = FlushedFractionCallback(FakeTrainer(), log)
    probe.sink.emit({"event": "flushed_probe", "when": "start"})
    log.write({"event": "log", "step": 1})
    assert [e["event"] for e in written] == ["flushed_probe", "log"]
    assert probe.results == [{"event": "flushed_probe", "when": "start"}] and len(log.sink.events) == 1
    assert log.sink.drain() == probe.results and log.sink.drain() == []

    class Announcer(ScalerObserver):
        def __init__(self):
            self.sink = EventSink()

        def on_update(self, scaler, rule_applied):
            self.sink.emit({"event": "updated", "rule": rule_applied})

    assert ScalerObserver().drain_events() == []  # an observer with nothing to say
    scaler = DynamicLossScaler(init_scale=4.0)
    scaler.observers.append(Announcer())
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
    assert scaler.drain_events() == [{"event": "updated", "rule": True}] * 2
    assert scaler.drain_events() == []
