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


def test_fsdp2_clip_grad_norm_is_the_global_norm(ranks):
    """`clip_grad_norm_` on DTensor gradients: the same (global) norm on both ranks as torch's
    clip_grad_norm_ after unscale_, both ranks skip the step with the inf in one shard. Bug caught:
    a rank-local norm (ranks disagree, the clean rank steps)."""
    import math

    for r in ranks:
        ours, theirs = r["fsdp2_clip"]["ours"], r["fsdp2_clip"]["torch"]
        assert ours["skipped"] == theirs["skipped"] == 1
        assert math.isinf(ours["norms"][2]) or math.isnan(ours["norms"][2])
        for a, b in zip(ours["norms"], theirs["norms"], strict=True):
            assert (
                (a == b)
                or (not math.isfinite(a) and not math.isfinite(b))
                or math.isclose(a, b, rel_tol=1e-6)
            )
        for a, b in zip(ours["params"], theirs["params"], strict=True):
            assert all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-7) for x, y in zip(a, b, strict=True))
    assert ranks[0]["fsdp2_clip"]["ours"]["norms"] == ranks[1]["fsdp2_clip"]["ours"]["norms"]
    assert ranks[0]["fsdp2_clip"]["ours"]["params"] == ranks[1]["fsdp2_clip"]["ours"]["params"]


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
    # rank 1's loss was non-finite (a forward overflow): every rank spares the scale, not only rank 1
    # (the loss flag is all-reduced; without it rank 0 backed off and the scales drifted apart)
    assert d0["history"][2]["scale"] == d0["history"][1]["scale"] == d1["history"][2]["scale"]


def test_ddp_with_fp16_weights_steps_fp32_masters_alike_on_every_rank(ranks):
    """A model held in FP16 under DDP (two gloo ranks): the all-reduce carries its FP16 gradients,
    an inf in rank 1's gradient reaches rank 0 through it and both skip; the FP32 masters and the
    FP16 weights written from them stay identical across ranks. Bugs caught: masters on one rank
    only (or none: "Attempting to unscale FP16 gradients"), a rank stepping the inf, ranks drifting."""
    d0, d1 = (r["ddp_masters"] for r in ranks)
    assert d0["history"] == d1["history"] and d0["params"] == d1["params"] and d0["masters"] == d1["masters"]
    assert [h["skipped"] for h in d0["history"]] == [False, False, True, False]
    assert d0["history"][2]["unchanged"] and not d0["history"][3]["unchanged"]
    assert {h["grad_dtype"] for h in d0["history"]} == {"torch.float16"}  # what the all-reduce carried
    assert (
        d0["n_masters"] == 4
        and d0["param_dtypes"] == ["torch.float16"]
        and d0["master_dtypes"] == ["torch.float32"]
    )
    assert d0["weights_are_rounded_masters"] and d1["weights_are_rounded_masters"]


def test_scaler_state_round_trips_through_distributed_checkpoint(ranks):
    for r in ranks:
        assert r["fsdp2"]["dcp_loaded"] == r["fsdp2"]["dcp_saved"]
    assert ranks[0]["fsdp2"]["dcp_loaded"] == ranks[1]["fsdp2"]["dcp_loaded"]


def test_found_inf_sync_is_chosen_by_distributed_type():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from hf_lossscale.integrations.accelerate_hook import needs_found_inf_sync

    def acc(kind, version=None):
        plugin = SimpleNamespace(fsdp_version=version) if version else None
        return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(fsdp_plugin=plugin))

    assert needs_found_inf_sync(acc(DistributedType.FSDP, 1))
    assert not needs_found_inf_sync(acc(DistributedType.FSDP, 2))  # DTensor: torch reduces the flag
    for kind in (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU, DistributedType.NO):
        assert not needs_found_inf_sync(acc(kind))  # DDP: gradients already all-reduced


def test_sync_found_inf_needs_a_process_group():
    from hf_lossscale import DynamicLossScaler

    with pytest.raises(RuntimeError, match="initialised torch.distributed"):
        DynamicLossScaler().sync_found_inf_across()


# The keys of DeepSpeed's `fp16` section, from its documentation (DeepSpeed does not install on this
# CPU-only machine, so the mapping is checked against the documented keys, not its parser).
DEEPSPEED_FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
                       "hysteresis", "consecutive_hysteresis", "min_loss_scale"}  # fmt: skip


def test_to_deepspeed_config():
    from hf_lossscale import LossScaleConfig
    from hf_lossscale.integrations.deepspeed import to_deepspeed_config

    with pytest.warns(UserWarning) as record:
        ds = to_deepspeed_config(
            LossScaleConfig(init_scale=2.0**12, growth_interval=500, hysteresis=2, min_scale=4.0)
        )
    assert ds == {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                  "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 4.0}  # fmt: skip
    assert set(ds) <= DEEPSPEED_FP16_KEYS
    text = str(record[0].message)
    assert (
        "max_scale=1.67772e+07" in text and "since the last overflow" in text and "growth_factor" not in text
    )
    with pytest.warns(
        UserWarning, match=r"init_scale=3000 is not a power of two.*growth_factor=4.*backoff_factor=0.25"
    ):
        ds = to_deepspeed_config(LossScaleConfig(init_scale=3000.0, growth_factor=4.0, backoff_factor=0.25))
    assert ds["initial_scale_power"] == 12
    assert to_deepspeed_config(LossScaleConfig(mode="static", init_scale=128.0)) == {
        "enabled": True,
        "loss_scale": 128.0,
    }
    assert to_deepspeed_config(LossScaleConfig(mode="off")) == {"enabled": False}


def test_deepspeed_fp16_section_is_checked_and_its_figures_logged():
    from types import SimpleNamespace

    from hf_lossscale import LossScaleConfig
    from hf_lossscale.integrations.deepspeed import to_deepspeed_config
    from hf_lossscale.integrations.trainer import check_deepspeed_fp16, deepspeed_scale_figures

    config = LossScaleConfig(init_scale=2.0**12, hysteresis=2)
    with pytest.warns(UserWarning, match=r"hysteresis=4 \(config: 2\).*not set there.*min_loss_scale"):
        keys = check_deepspeed_fp16(config, {"enabled": True, "loss_scale": 0, "initial_scale_power": "auto",
                                             "loss_scale_window": 2000, "hysteresis": 4,
                                             "consecutive_hysteresis": False})  # fmt: skip
    assert keys == ["hysteresis", "min_loss_scale"]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.warns(UserWarning):  # only to_deepspeed_config's own note, which the check silences
            section = to_deepspeed_config(config)
        assert check_deepspeed_fp16(config, section) == []
    engine = SimpleNamespace(optimizer=SimpleNamespace(cur_scale=1024.0), skipped_steps=3)
    assert deepspeed_scale_figures(engine) == {"loss_scale": 1024.0, "skipped_steps": 3}
    nested = SimpleNamespace(optimizer=SimpleNamespace(loss_scaler=SimpleNamespace(cur_scale=8.0)))
    assert deepspeed_scale_figures(nested) == {"loss_scale": 8.0}


@pytest.mark.cuda
@pytest.mark.parametrize("version", [1, 2])
def test_accelerate_fsdp_on_two_gpus(tmp_path, version):
    """GPU only (two GPUs): Accelerate's FSDP path; written for gpu_check, not run on the CPU machine."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(root / "recipes" / "configs" / "fsdp_fp16.yaml"), "--num_processes", "2",
           str(Path(__file__).parent / "scripts" / "accelerate_fsdp_check.py"), str(tmp_path), str(version)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["skipped"] == r1["skipped"] == [False, False, True, False]
    assert r0["sync"] is (version == 1) and r1["sync"] is (version == 1)
    assert (
        r0["after"] == r0["before"] == r1["after"]
    )  # save_state/load_state keep the scale (accelerate#4289)


@pytest.mark.cuda
def test_trainer_under_deepspeed(tmp_path):
    """GPU + DeepSpeed only: written for gpu_check, not run on the CPU machine."""
    pytest.importorskip("deepspeed")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
           str(Path(__file__).parent / "scripts" / "deepspeed_check.py"), str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "deepspeed.json").read_text())
    assert result["loss_scaler"] is False and result["warned_hysteresis"]
    assert result["scales"][0] == 1024.0 and result["skipped"][-1] >= 1  # the engine's own figures
    assert result["scales"][-1] < result["scales"][0]  # the engine backed off on the injected inf


TWIN = Path(__file__).parent / "scripts" / "ddp_twin.py"


def test_ddp_and_accelerate_with_fp16_weights_train_on_masters_as_the_fp32_reference(tmp_path):
    """Issue 55: generated programs (micro-batches under `no_sync()` / `accelerator.accumulate`, an inf or NaN on
    one rank only, clipping over the model's parameters, AdamW, fused AdamW, SGD with momentum, RMSprop) on 2
    gloo ranks, plain DDP with `gradient_as_bucket_view` False and True and through Accelerate, a model held
    in FP16 against FP32 weights computing in FP16: weights, masters, optimizer state, statistics and skips
    agree after every step on both ranks. Bugs caught: a marker left where DDP expects its bucket view (the
    reducer copies its storage), an inf on one rank stepping the other, `no_sync` gradients lost at the read."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(TWIN), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text())["runs"] for r in (0, 1))
    assert len(r0) == len(r1) >= 8
    assert {(r["path"], r["bucket_view"]) for r in r0} == {
        (p, b) for p in ("ddp", "accelerate") for b in (False, True)
    }
    for a, b in zip(r0, r1, strict=True):
        assert a["differences"] == [] and b["differences"] == [], (a, b)
        assert a["skipped"] == b["skipped"] and a["masters"] == 3
    skips = [s for r in r0 for s in r["skipped"]]
    assert 0 < sum(skips) < len(skips)  # the programs hold one-rank overflows and clean steps
