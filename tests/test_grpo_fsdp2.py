"""GRPO in FP16 under FSDP2 on two gloo ranks (the CPU), through the Trainer and Accelerate
(`tests/scripts/grpo_fsdp2_check.py`, one `torch.distributed.run` launch per mode).

Accelerate applies FSDP only on accelerator devices: on the CPU it drops the plugin and runs DDP.
`FP16GRPOTrainer` refuses that (the user asked for sharding and would not get it); the skip-aware
run lifts that one gate in the script, so the model goes through Accelerate's own FSDP2 preparation
(DTensor parameters and gradients) as it does on GPUs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytestmark = pytest.mark.multiprocess
SCRIPT = Path(__file__).parent / "scripts" / "grpo_fsdp2_check.py"


def launch(out: Path, mode: str) -> list[dict]:
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
         str(out), mode],
        capture_output=True, text=True, timeout=150, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_grpo_fp16_under_fsdp2_skips_on_every_rank(tmp_path):
    """An inf in rank 1's gradient shard only (after the reduce-scatter, before the scaler reads the
    gradients) at step 2 of 4: both ranks skip step 2 and back off to the same scale, the full
    parameters stay where step 1 left them on both ranks (and equal across them), the LR scheduler
    and TRL's micro-step counter do not advance, the applied-step count (the scaler's counters) reads
    1, 1, 2, 3 on both, one `grpo_skip` event says so, and the mismatch figures are those of the
    whole batch, the same on both ranks (every rank's completions gathered). Bugs caught: the clean
    rank stepping (ranks drift apart), a rank-local count, figures of rank 0's share only (they
    differed by 2x here before the gather)."""
    r0, r1 = launch(tmp_path / "fsdp2", "fsdp2")
    for r in (r0, r1):
        assert (
            r["world_size"] == 2
            and r["distributed_type"] == "DistributedType.FSDP"
            and r["fsdp_version"] == 2
        )
        assert r["param_types"] == ["DTensor"]  # sharded by fully_shard, not replicated
        rows = r["rows"]
        assert [row["skipped"] for row in rows] == [False, True, False, False]
        assert [row["scale"] for row in rows] == [1024.0, 512.0, 512.0, 512.0]
        assert [row["applied_steps"] for row in rows] == [1, 1, 2, 3] == r["logged_applied_steps"]
        assert [row["trl_step"] for row in rows] == [1, 1, 2, 3]
        assert [row["scheduler_steps"] for row in rows] == [1, 1, 2, 3]
        assert rows[1]["params"] == rows[0]["params"] and rows[2]["params"] != rows[1]["params"]
        assert (
            r["stats"] == {"total_steps": 4, "skipped_steps": 1, "loss_scale": 512.0}
            and r["applied_steps"] == 3
        )
        (skip,) = r["skip_events"]
        assert skip["step"] == 2 and skip["applied_steps"] == 1 and skip["loss_scale"] == 512.0
        assert [e["step"] for e in r["mismatch_events"]] == [1, 2, 3, 4]
    assert [row["params"] for row in r0["rows"]] == [row["params"] for row in r1["rows"]]
    logged = r0["logged_mismatch"]
    assert logged == r1["logged_mismatch"] and all(v is not None for v in logged)
    assert logged == [e["mean_abs_dlogp"] for e in r0["mismatch_events"]]


def test_fsdp_on_the_cpu_is_refused_where_accelerate_would_run_ddp(tmp_path):
    """Without the script's gate lifted, Accelerate turns `fsdp=True` on the CPU into DDP; both ranks
    get a ValueError that says so and names the two ways that work. Bug caught: a run the user
    believes sharded that is DDP."""
    for r in launch(tmp_path / "cpu", "accelerate-on-cpu"):
        message = r["refused"]
        assert "fsdp=True" in message and "MULTI_CPU" in message and "wraps the model in DDP" in message
        assert "Drop fsdp on the CPU" in message and "FSDP2 on GPUs" in message
