"""Crash and resume: a Trainer run SIGKILLed at chosen moments (between steps, and at three points
inside a checkpoint save), then resumed with `resume_from_checkpoint=True`, ends with weights
bitwise equal to the uninterrupted run's and the same scale history. The long version (more
kill points, including SIGKILLs from outside at random steps) runs with `-m slow`."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

SCRIPT = Path(__file__).parent / "scripts" / "crash_train.py"
CI_KILLS = ["step:5", "save-model:6", "save-scaler:8", "save-state:10"]
# every kill point has a complete checkpoint before it (checkpoint-2 onwards) to resume from
SLOW_KILLS = ["step:3", "step:9", "step:12", "save-model:4", "save-scaler:4", "save-state:6", "save-state:12"]


def run(output_dir, *extra, check=True):
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(output_dir), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def scale_history(output_dir):
    """step -> (loss_scale, skipped_steps) from every log event; a step run again after a resume
    overwrites the first attempt (the crashed run's steps past its checkpoint are redone)."""
    history = {}
    for line in (Path(output_dir) / "loss_scale_log.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "log" and "loss" in event:
            history[event["step"]] = (event["loss_scale"], event["skipped_steps"])
    return history


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("baseline")
    run(out)
    history = scale_history(out)
    assert len(history) == 12 and history[12][1] == 3  # the three injected overflows were skipped
    assert len({scale for scale, _ in history.values()}) > 2  # the scale grew and backed off
    return load_file(out / "final" / "model.safetensors"), history


def crash_and_resume(tmp_path, baseline, kill=None, external_after_step=None):
    out = tmp_path / "run"
    if kill is not None:
        proc = run(out, "--kill", kill, check=False)
    else:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        log = out / "loss_scale_log.jsonl"
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            if (
                log.exists()
                and sum('"loss":' in line for line in log.read_text().splitlines()) >= external_after_step
            ):
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run was not killed"
    resumed = run(out, "--resume")
    weights, history = baseline
    final = load_file(out / "final" / "model.safetensors")
    assert final.keys() == weights.keys()
    assert all(torch.equal(final[k], weights[k]) for k in weights), (
        "weights differ from the uninterrupted run"
    )
    assert scale_history(out) == history
    return out, resumed


@pytest.mark.parametrize("kill", CI_KILLS)
def test_killed_run_resumes_bitwise(tmp_path, baseline, kill):
    out, resumed = crash_and_resume(tmp_path, baseline, kill=kill)
    point, step = kill.split(":")
    if point.startswith("save"):
        # the checkpoint cut short is still there (nothing deleted), and was skipped by name
        assert (out / f"checkpoint-{step}").is_dir()
        assert f"Skipping incomplete checkpoint {out / f'checkpoint-{step}'}" in resumed.stderr


@pytest.mark.slow
@pytest.mark.parametrize("kill", SLOW_KILLS)
def test_killed_run_resumes_bitwise_more_points(tmp_path, baseline, kill):
    crash_and_resume(tmp_path, baseline, kill=kill)


@pytest.mark.slow
@pytest.mark.parametrize("after", random.Random(0).sample(range(4, 12), 4))
def test_external_sigkill_at_random_step_resumes_bitwise(tmp_path, baseline, after):
    crash_and_resume(tmp_path, baseline, external_after_step=after)


def test_resume_with_no_complete_checkpoint_is_an_error(tmp_path):
    out = tmp_path / "run"
    proc = run(out, "--kill", "save-state:2", check=False)
    assert proc.returncode == -signal.SIGKILL
    proc = run(out, "--resume", check=False)
    assert proc.returncode != 0 and "No complete checkpoint found" in proc.stderr


def test_truncated_scaler_state_fails_naming_the_file(tmp_path):
    out = tmp_path / "run"
    run(out, "--kill", "step:5", check=False)
    scaler_file = out / "checkpoint-4" / "scaler.pt"
    scaler_file.write_bytes(scaler_file.read_bytes()[:40])
    proc = run(out, "--resume", check=False)
    assert proc.returncode != 0
    assert f"Cannot read the loss-scaler state {scaler_file}" in proc.stderr
    assert "--loss_scale_fresh_on_resume" in proc.stderr
