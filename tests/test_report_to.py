"""`--report_to`: the loss-scale scalars and the gradient exponent histograms in TensorBoard (read
back from the event file with TensorBoard's own reader), and the scalars in MLflow (the other
backend that runs offline here: a local file store, read back with MLflow's client)."""

import json
from pathlib import Path

import pytest
from test_trainer import train


def read_events(output_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(Path(output_dir).rglob("events.out.tfevents.*"))
    assert len(files) == 1, files  # one event file: the histograms go through the Trainer's writer
    events = EventAccumulator(str(files[0]), size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    return events


def test_scalars_and_histograms_reach_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    trainer, _, _, _ = train(tmp_path, bad_steps=(4,), report_to=["tensorboard"], loss_scale_telemetry_interval=2,
                             loss_scale_activation_probe=True, max_steps=8)  # fmt: skip
    events = read_events(tmp_path / "out")
    scalars = events.Tags()["scalars"]
    for name in ("loss_scale", "skipped_steps", "overflow_rate", "grad_zero_frac", "grad_subnormal_frac",
                 "headroom_bits", "act_grad_lost_frac"):  # fmt: skip
        assert f"train/{name}" in scalars, (name, scalars)
    skipped = {e.step: e.value for e in events.Scalars("train/skipped_steps")}
    assert skipped[4] == 0 and skipped[6] == 1 and skipped[8] == 1  # the step-4 overflow, where it happened
    histograms = events.Tags()["histograms"]
    assert {"loss_scale/grad_log2", "loss_scale/act_grad_log2"} <= set(histograms)
    modules = {h.split("/", 2)[2] for h in histograms if h.startswith("loss_scale/grad_log2/")}
    assert {"bert.embeddings", "bert.encoder.layer.0", "classifier"} <= modules, modules

    # Each histogram is the event log's telemetry snapshot of that step, bin for bin: a shifted bin
    # (2^-24 written as 2^-23) or a snapshot written at another step fails here.
    log = [json.loads(line) for line in (tmp_path / "out" / "loss_scale_log.jsonl").read_text().splitlines()]
    snapshots = {e["step"]: e["counts"] for e in log if e.get("source") == "param_grads"}
    written = {h.step: h.histogram_value for h in events.Histograms("loss_scale/grad_log2")}
    # Snapshots and histograms sit at the step they were measured at (every second optimizer step from
    # the first; issue 48: they sat at the log step that read them). A snapshot of only inf/NaN (the
    # overflowed optimizer step 5's, read by the log at step 6) has nothing on a log2 axis.
    assert sorted(snapshots) == [1, 3, 5, 7]
    finite = {step for step, counts in snapshots.items() if sum(counts[1:-1])}
    assert set(written) == finite and len(written) >= 3 and 5 not in finite
    for step, hist in written.items():
        counts = snapshots[step]
        assert list(hist.bucket_limit) == [float(e) for e in range(-24, 18)]
        assert list(hist.bucket) == counts[1:-1]  # `<2^-24` .. `>=2^16`, zeros and inf/NaN apart
        assert hist.num == sum(counts[1:-1])
        lowest = next(i for i, c in enumerate(counts[1:-1]) if c)
        assert hist.min == -25 + lowest


def test_histogram_of_known_values():
    """log2|g| bins: 2^-30 (flushed in FP16) in [-25,-24); 3.0 in [1,2); 1e5 in [16,17)."""
    import torch

    from hf_lossscale.core.telemetry import bucket_counts
    from hf_lossscale.integrations.tensorboard import log2_histogram

    h = log2_histogram(bucket_counts(torch.tensor([0.0, 2.0**-30, 3.0, 3.5, 1e5, float("inf")])).tolist())
    bins = dict(zip(h["bucket_limits"], h["bucket_counts"]))
    assert (bins[-24.0], bins[2.0], bins[17.0], h["num"]) == (1, 2, 1, 4)
    assert (h["min"], h["max"]) == (-25.0, 17.0)
    assert log2_histogram(bucket_counts(torch.zeros(3)).tolist()) is None


def test_scalars_reach_mlflow(tmp_path, monkeypatch):
    """Bug caught: a loss-scale field that a backend other than TensorBoard drops, or logs at the wrong
    step (the step-4 overflow must show at step 6, the next log)."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store, offline
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "loss-scale")
    train(tmp_path, bad_steps=(4,), report_to=["mlflow"], loss_scale_telemetry_interval=2, max_steps=8)
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("loss-scale").experiment_id])
    assert {"loss_scale", "skipped_steps", "overflow_rate", "grad_zero_frac", "grad_subnormal_frac"} <= set(
        run.data.metrics
    )
    skipped = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "skipped_steps")}
    assert (skipped[4], skipped[6], skipped[8]) == (0, 1, 1)
