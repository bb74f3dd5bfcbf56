"""A signal stops a comparison within seconds: nothing new starts, no child is left, no half-written
result (issue 37, item 5)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_models import save_tiny_bert

ROOT = Path(__file__).resolve().parents[1]


def _processes_mentioning(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if marker in line and "ps -eo" not in line]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_a_two_job_comparison(tmp_path, sig):
    """Bug caught: the pool launched every queued run after the signal killed the running ones (30 s
    later `compare --jobs 2` still ran), and accelerate's training process outlived its launcher."""
    model = save_tiny_bert(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"a line of words number {i} for a tiny model to read" for i in range(400)))
    out = tmp_path / "cmp-signal"
    cmd = [
        sys.executable, "-m", "hf_lossscale.tools.cli", "compare", str(ROOT / "recipes" / "language_modeling.py"),
        "--max_steps", "5000", "--output_dir", str(out), "--jobs", "2", "--seeds", "0", "1", "2",
        "--settings", "fp32,dynamic",
        "--", "--model_name_or_path", str(model), "--objective", "clm", "--train_file", str(text),
        "--block_size", "16", "--per_device_train_batch_size", "2", "--report_to", "none",
        "--save_strategy", "no", "--disable_tqdm", "true", "--eval_strategy", "no",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    runs = out / "runs"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # both jobs training: their event logs exist
        logs = list(runs.glob("*/loss_scale_log.jsonl")) if runs.exists() else []
        if len(logs) >= 2:
            break
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("the runs did not start within 120 s")
    started = sorted(p.name for p in runs.iterdir())
    assert len(started) == 2
    proc.send_signal(sig)
    t0 = time.monotonic()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the comparison still ran 30 s after the signal")
    assert time.monotonic() - t0 < 15
    assert proc.returncode == 128 + sig
    time.sleep(1)
    assert _processes_mentioning(str(out)) == []  # no launcher, no training process left
    assert sorted(p.name for p in runs.iterdir()) == started  # nothing new started
    assert not (out / "summary.md").exists() and not (out / "metrics.json").exists()
    assert not list(out.rglob("*.tmp"))
