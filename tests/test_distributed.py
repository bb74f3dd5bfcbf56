"""Two real gloo ranks on the CPU (`torch.distributed.run --nproc_per_node 2`, one launch for all):
FSDP2 with an inf in one rank's shard and an empty shard on the other; local shards with and
without `sync_found_inf_across()`; DDP through Accelerate (MULTI_CPU); the scaler state through
torch distributed checkpointing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "dist_check.py"
pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT), str(out)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in results] == [2, 2]
    return results


def test_fsdp2_inf_in_one_shard_skips_on_every_rank(ranks):
    h0, h1 = (r["fsdp2"]["history"] for r in ranks)
    assert h0 == h1  # skips, scale, trackers and full parameters identical on both ranks
    assert [h["skipped"] for h in h0] == [False, False, False, True, False, False]
    assert h0[3]["unchanged"] and not h0[2]["unchanged"]
    assert h0[3]["scale"] == h0[2]["scale"] / 2
    assert ranks[1]["fsdp2"]["overflow_params"] == ["0.weight"]  # named where the inf was


def test_rank_with_an_empty_shard_does_not_hang(ranks):
    assert ranks[1]["fsdp2"]["local_shapes"]["2.weight"] == [0, 16]
    assert ranks[0]["fsdp2"]["local_shapes"]["2.weight"] == [1, 16]


def test_local_shards_need_and_get_the_found_inf_all_reduce(ranks):
    synced = [r["local_sync"] for r in ranks]
    assert synced[0] == synced[1] and synced[0]["history"][1]["skipped"]
    unsynced = [r["local_nosync"] for r in ranks]
    # without the all-reduce only the rank that saw the NaN skips, and the replicas drift apart
    assert [u["history"][1]["skipped"] for u in unsynced] == [False, True]
    assert unsynced[0]["params"] != unsynced[1]["params"]


def test_ddp_through_accelerate(ranks):
    d0, d1 = (r["ddp"] for r in ranks)
    assert d0["distributed_type"] == "DistributedType.MULTI_CPU" and d0["num_processes"] == 2
    assert d0["history"] == d1["history"] and d0["params"] == d1["params"]
    assert [h["skipped"] for h in d0["history"]] == [False, False, True, False]
    assert d0["history"][2]["unchanged"]


def test_scaler_state_round_trips_through_distributed_checkpoint(ranks):
    for r in ranks:
        assert r["fsdp2"]["dcp_loaded"] == r["fsdp2"]["dcp_saved"]
    assert ranks[0]["fsdp2"]["dcp_loaded"] == ranks[1]["fsdp2"]["dcp_loaded"]
