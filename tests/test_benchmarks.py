"""Smoke tests: every benchmark script runs at a tiny size, so none can rot."""

import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_telemetry_overhead_smoke(tmp_path):
    """The script runs end to end on the tiny model and writes what it reports; the snapshot it times
    covers every parameter tensor of the model (a snapshot of a subset would understate the cost)."""
    from tiny_models import tiny_bert_config
    from transformers import BertForSequenceClassification

    out = tmp_path / "t.json"
    result = load("telemetry_overhead").main(["--tiny", "--repeats", "2", "--output", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    expected = len(list(BertForSequenceClassification(tiny_bert_config()).parameters()))
    assert result["tensors"] == expected and result["snapshot_median_s"] > 0


def test_fp16_emulation_speed_smoke(tmp_path):
    out = tmp_path / "e.json"
    result = load("fp16_emulation_speed").main(
        ["--tiny", "--repeats", "1", "--batch", "2", "--seq", "8", "--out", str(out)]
    )
    assert json.loads(out.read_text())["emulated_over_fp32"] == result["emulated_over_fp32"] > 0
    assert result["fp16_weights_native_over_products"] > 0 and result["fp16_weights_products_over_fp32"] > 0


def test_step_overhead_smoke(tmp_path):
    out = tmp_path / "s.json"
    result = load("step_overhead").main(["--tiny", "--output", str(out)])
    assert json.loads(out.read_text())["setup"]["tensors"] == 20
    for kind in ("adamw_foreach", "adamw_fused", "sgd"):
        rows = result["rows"][kind]
        assert rows["GradScaler"]["vs_GradScaler"] == 1.0  # the baseline row is the baseline
        syncs = result["syncs"][kind]
        # the counts the benchmark reports are the ones the scaler promises
        assert syncs["DynamicLossScaler"] == syncs["+ telemetry"] == (0 if kind == "adamw_fused" else 1)
        assert syncs["DynamicLossScaler"] <= syncs["GradScaler"]


def test_step_overhead_clip_table(tmp_path):
    """The clip table's sync column counts what each design reads on the host per step: torch's
    sequence and the DeepSpeed-style fold read the found-inf flag with foreach AdamW, ours with
    fused AdamW reads nothing."""
    result = load("step_overhead").main(["--tiny", "--clip_only", "--output", str(tmp_path / "c.json")])
    rows = result["clip"]["rows"]
    syncs = {row: r["syncs_added"] for row, r in rows.items()}
    assert syncs == {
        "torch: unscale_ + clip_grad_norm_ (AdamW foreach)": 1,
        "torch: unscale_ + clip_grad_norm_ (AdamW fused)": 0,
        "DeepSpeed-style: norm, then one multiply (AdamW foreach)": 1,
        "ours: clip_grad_norm_ (AdamW fused)": 0,
        "ours: clip_grad_norm_ (AdamW foreach)": 1,
    }
    for r in rows.values():
        assert 0 <= r["step_faster_in"] <= r["repeats"] == 2


def test_gpu_scripts_parse_and_gpu_check_py_needs_a_gpu():
    """The shell scripts parse (a syntax error would cost a GPU session); `gpu_check.py` without a
    GPU says so (exit 2) instead of reporting a comparison it did not make. What the scripts do is
    run without a GPU by `test_gpu_check_without_a_gpu_says_skipped` and `gpu_dryrun.sh`."""
    import subprocess

    for script in ("gpu_check.sh", "gpu_dryrun.sh"):
        assert subprocess.run(["bash", "-n", str(BENCH / script)]).returncode == 0  # parses
    import torch

    if not torch.cuda.is_available():
        assert load("gpu_check").main([]) == 2  # says it needs a GPU, does not pretend


def test_gpu_check_logic_runs_on_the_cpu():
    """The GPU check's comparisons, run against CPU autocast: they execute and produce their table
    (on a GPU they compare against CUDA autocast). The CPU policy's own oracle test is
    tests/test_autocast_tables.py; here mismatches between CPU autocast and the CUDA policy are
    expected (softmax, pow, ... are FP32 only on CUDA) and show that the comparison can fail."""
    gpu = load("gpu_check")
    ops = gpu.check_ops(device="cpu")
    assert ops["checked"] > 300 and not ops["ok"]
    assert any(m.startswith("softmax/fp16") for m in ops["mismatches"])
    arch = gpu.check_architectures(tiny=True, device="cpu")
    assert [r["arch"] for r in arch["rows"]] == ["gpt2"] * 6 + ["llama"] * 6 + ["t5"] * 6
    assert set(arch["large_activations"]) == {"gpt2", "llama", "t5"}
    text = gpu.table({"ops": ops, "architectures": arch})
    assert text.count("| llama |") == 6 and "mismatches" in text


def test_emulation_fidelity_smoke(tmp_path):
    result = load("emulation_fidelity").main(
        ["--archs", "gpt2", "--batch", "1", "--seq", "8", "--output", str(tmp_path / "f.json")]
    )
    assert len(result["gpt2"]["cpu"]) == 6 and "large_activations" in result["gpt2"]
    assert json.loads((tmp_path / "f.json").read_text())["archs"]["gpt2"]["cpu"][0]["divisor"] == 1


def test_gpu_prepare_manifest_is_checked():
    """The carried folder's manifest: the wheels are the tested pins, each package has its wheel,
    and what travels fits in 64 MiB. Bug caught: a stale wheel (transformers 5.17) or a folder that
    would be refused for its size."""
    from hf_lossscale.integrations.compat import TESTED_VERSIONS, major_minor

    prep = load("gpu_prepare")
    pins = prep.pinned()
    for name in ("transformers", "accelerate"):
        assert major_minor(pins[name]) == TESTED_VERSIONS[name]
    good = {
        "packages": {"transformers": "5.24.0"},
        "wheels": {"transformers": "transformers-5.24.0-py3-none-any.whl"},
        "carried_bytes": 40 * 2**20,
        "tree_bytes": 2 * 2**20,
        "limit_bytes": prep.LIMIT_BYTES,
    }
    assert prep.check(good) == []
    assert prep.check({**good, "wheels": {"transformers": "transformers-5.17.0-py3-none-any.whl"}})
    assert prep.check({**good, "wheels": {}}) == ["no wheel for transformers"]
    assert "over the 64 MiB limit" in prep.check({**good, "carried_bytes": 63 * 2**20})[0]
    prepared = BENCH.parent / ".whl" / "manifest.json"
    if prepared.exists():  # one prepared here: it must pass too
        assert prep.check(json.loads(prepared.read_text())) == []


def test_gpu_check_without_a_gpu_says_skipped(tmp_path):
    """Every CUDA step reports "skipped: no GPU", none "passed", and the run exits 0."""
    import os
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the real check runs instead")
    # The time boxes are sized for the lent 16-core machine; on a loaded 2-core CI machine the CPU
    # step's imports alone took 45 s once. This test is about which steps run and what they say.
    # PYTHON: this interpreter, not `python3` from PATH (a venv's suite run without activating it
    # would otherwise check a Python that lacks torch).
    env = {
        **os.environ,
        "GPU_CHECK_WHEELS": str(tmp_path / "none"),
        "GPU_CHECK_TIME_SCALE": "4",
        "PYTHON": sys.executable,
    }
    proc = subprocess.run(["bash", str(BENCH / "gpu_check.sh"), str(tmp_path / "out")], capture_output=True,
                          text=True, env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("skipped: no GPU") == 12
    import re

    # The CPU step runs (imports, a recipe parses); no CUDA step (1-12) reports "passed".
    assert re.search(r"== 0b\. CPU: .*: passed", proc.stdout)
    assert not re.search(r"== (1[012]|[1-9])\. .*passed", proc.stdout), proc.stdout
    assert (tmp_path / "out" / "summary.txt").read_text().count("skipped: no GPU") == 12


def test_underflow_map_smoke(tmp_path):
    """The README's underflow map script, at two small points per objective on a tiny BERT, with the
    Python docs as text when no data folder is given (cls gets alternating labels)."""
    import sys

    sys.path.insert(0, str(BENCH.parent / "tests"))
    from tiny_models import save_tiny_bert

    model = save_tiny_bert(tmp_path / "model")
    out = tmp_path / "map"
    assert load("underflow_map").main(["--quick", "--model_name_or_path", model, "--data_dir", str(tmp_path / "none"),
                                       "--output_dir", str(out)]) == 0  # fmt: skip
    for objective in ("clm", "mlm", "cls"):
        rows = json.loads((out / f"underflow_{objective}.json").read_text())["rows"]
        assert len(rows) == 2 and all(not r["at_settled"]["overflow"] for r in rows)
    assert (out / "underflow.png").read_bytes()[:4] == b"\x89PNG"


def test_fp32_module_cost_smoke(tmp_path):
    """The table's rows exist, memory is counted (the baseline holds activations), ratios are
    against the baseline in the same process. Bug caught: a setting that wraps nothing (its memory
    would equal the baseline's)."""
    result = load("fp32_module_cost").main(["--repeats", "2", "--batch", "1", "--seq", "8",
                                             "--out", str(tmp_path / "c.json")])  # fmt: skip
    rows = result["settings"]
    assert list(rows) == ["none", "attention block", "query projection"]
    assert rows["none"]["saved_bytes"] > 0 and rows["none"]["memory_ratio"] == 1.0
    assert rows["attention block"]["saved_bytes"] != rows["none"]["saved_bytes"]
    assert json.loads((tmp_path / "c.json").read_text())["settings"]["query projection"]["modules"] == [
        "encoder.layer.3.attention.self.query"
    ]


def test_many_tensors_smoke(tmp_path):
    result = load("many_tensors").main(
        ["--tensors", "300", "--repeats", "2", "--out", str(tmp_path / "m.json")]
    )
    assert set(result["rows"]) == {"torch GradScaler", "DynamicLossScaler (names resolved)"}


def test_forward_overflow_rescaling_keeps_the_fp32_function_bitwise():
    """The benchmark's claim: multiplying the query by 2^k and dividing the key by 2^k changes no
    FP32 value the model computes. Bug caught: a non-power-of-two factor, or scaling the bias of one
    and not the other (logits would move)."""
    import torch
    from tiny_models import tiny_bert_classifier

    model = tiny_bert_classifier(0).eval()
    ids = torch.randint(5, 100, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        name = load("forward_overflow").rescale_attention(model, 1, 16)
        after = model(input_ids=ids).logits
    assert name == "bert.encoder.layer.1.attention.self.query"
    assert torch.equal(before, after)


def test_op_count_table_is_exact():
    """benchmarks/op_count.py's rows, held to the number (the counts are deterministic). Bug caught:
    a change that adds device ops to the scaler's step (each at least one kernel launch on CUDA)
    without the table, the README and this test saying so. Torch's column pins the counter itself:
    a counter that missed ops would show torch's 9 as fewer."""
    op_count = load("op_count")
    rows, variants = op_count.table()
    got = {r["row"]: (r["torch"], r["ours"]) for r in rows}
    assert got == {
        "clean step, fused AdamW, no clip": (9, 13),
        "clean step, fused AdamW, clip": (18, 22),
        "clean step, foreach AdamW, no clip": (10, 10),
        "clean step, foreach AdamW, clip": (18, 21),
        "around a skipped step (beyond two clean steps), fused, no clip": (0, 3),
        "around a skipped step (beyond two clean steps), fused, clip": (0, 2),
        "around a skipped step (beyond two clean steps), foreach, no clip": (0, 7),
        "around a skipped step (beyond two clean steps), foreach, clip": (0, 5),
    }
    # issue 28: a clean step within 4 ops of torch's; issue 45 added one in `scale` (the loss poisons its
    # own gradients) and one in the fused `update` (a non-finite loss counts where its gradients skipped);
    # issue 56 left the clamp out where the host shows it cannot bind: within 4 again
    for row, (torch_ops, ours) in got.items():
        assert ours <= torch_ops + (7 if row.startswith("around") else 4), row
    assert variants == {
        "ours, min/max scale": 13,
        "ours, hysteresis 2": 39,
        "ours, telemetry every step": 856,
    }


def test_master_weights_benchmark_counts_what_it_says(tmp_path):
    """The gradient hand-over timing runs both implementations on the same gradients, and one memory
    row (MiniLM, LoRA on an FP16 base) counts masters of 4 bytes per trainable parameter and none for
    the frozen base. Bug caught: masters made for frozen parameters, or a row that counts the wrong
    dtype."""
    import json

    bench = load("master_weights")
    cost = bench.step_cost(2, n_tensors=4, numel=1024)
    assert cost["ours_ms"] > 0 and cost["obvious_ms"] > 0
    import subprocess
    import sys

    spec = {"model": "minilm", "lora": True, "weights": "fp16"}
    proc = subprocess.run([sys.executable, "-c", bench.CHILD, json.dumps(spec)], capture_output=True, text=True,
                          check=True, timeout=600)  # fmt: skip
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["masters_bytes"] == 4 * row["trainable"] and row["trainable"] < row["parameters"] / 100
    assert row["weights_bytes"] < 2.1 * row["parameters"]  # the frozen base stays FP16


def test_fp16_without_masters_benchmark_runs_both_arms(tmp_path):
    """Three steps at one learning rate: both arms from the same weights and batches, the lost share
    measured per step. Bug caught: the arms drifting apart before their first step (other weights or
    batches), or the masters' arm measuring nothing."""
    import json

    bench = load("fp16_without_masters")
    out = tmp_path / "r.json"
    assert bench.main(["--steps", "3", "--lrs", "1e-3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["arm"] for r in rows] == ["masters", "pure"]
    assert rows[0]["loss"][0] == rows[1]["loss"][0]
    assert len(rows[0]["lost_share"]) == 2 and all(0 <= x <= 1 for x in rows[0]["lost_share"])


def test_below_the_floor_measures_each_arms_lost_updates():
    """Four steps at lr 1e-5 on the tiny GPT-2: every arm from the same weights and batches; FP32 masters
    lose almost none, stochastic rounding loses some at each step (the FP16 weight alone holds them).
    Bug caught: the step loop (shared with update_loss.py) returning the wrong share, or measuring the
    first step (before the masters exist)."""
    import sys

    sys.path.insert(0, str(BENCH))
    bench = load("below_the_floor")
    data, held_out = bench._data(0, 4)
    rows = {
        arm: bench.run(arm, 1e-5, 0, data, held_out[:2]) for arm in ("fp32", "masters", "stochastic_rounding")
    }
    assert rows["masters"]["loss"][0] == rows["stochastic_rounding"]["loss"][0]  # the same FP16 start
    assert rows["fp32"]["lost_share"] == [] and len(rows["masters"]["lost_share"]) == 3
    assert all(x < 1e-3 for x in rows["masters"]["lost_share"])  # (an FP32 master loses a few as FP32 does)
    assert all(x > 0.1 for x in rows["stochastic_rounding"]["lost_share"])
    assert rows["stochastic_rounding"]["lost_share"] == rows["stochastic_rounding"]["fp16_unmoved_share"]


def test_torch_gradscaler_block_runner_rebinds_every_name(tmp_path):
    """The runner of torch's GradScaler block, on a stand-in block that records which class each
    GradScaler name resolves to: all three bound to ours (and torch's with REBIND=0). Bug caught: a
    name left as torch's, so that part of torch's block would test torch against itself."""
    import os
    import subprocess
    import sys

    block = tmp_path / "block.py"
    out = tmp_path / "names.txt"
    block.write_text(
        "import torch\n"
        "def test_names():\n"
        f"    open({str(out)!r}, 'w').write(' '.join(c.__module__ for c in (torch.GradScaler, torch.amp.GradScaler,"
        " torch.amp.grad_scaler.GradScaler)))\n"
    )
    script = BENCH / "torch_gradscaler_block.py"
    for rebind, expected in (("1", "hf_lossscale.core.scaler"), ("0", "torch.amp.grad_scaler")):
        proc = subprocess.run([sys.executable, str(script), str(block), "-q"], capture_output=True, text=True,
                              env={**os.environ, "REBIND": rebind}, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert out.read_text().split() == [expected] * 3
    assert load("torch_gradscaler_block").main([]) == 2  # no block: says how to get one


def test_grpo_compare_reads_runs_and_words_lower_is_better(tmp_path, monkeypatch):
    """`grpo_compare.summarize` on three seeds of event logs written by hand: the per-run figures
    come from the right events, and a setting whose mismatch is higher in every seed is "higher
    (worse)" (lower is better for a mismatch), its equal reward "no measurable difference". Bugs
    caught: the verdict's direction taken from the metric's name (a mismatch read as accuracy-like),
    a run that failed counted, figures read from eval logs."""
    import json

    grpo = load("grpo_compare")
    monkeypatch.setattr(grpo, "OUT", tmp_path / "results")
    folder = tmp_path / "cmp"
    for setting, bump in (("fp32", 0.0), ("dynamic", 1e-4), ("bf16", 1e-3)):
        for seed in (0, 1, 2):
            run = folder / "runs" / f"{setting}-seed{seed}"
            run.mkdir(parents=True)
            events = [{"event": "run_start"}]
            for step in range(1, 31):
                events.append({"event": "log", "step": step, "loss": 0.0, "reward": min(1.0, step / 20)})
                events.append({"event": "mismatch", "step": step, "mean_abs_dlogp": bump + seed * 1e-6,
                               "p95_abs_dlogp": 2 * bump, "max_abs_dlogp": 3 * bump + seed * 1e-5,
                               "outside_band_frac": 0.0, "k3_kl": bump / 10})  # fmt: skip
            events.append({"event": "log", "step": 30, "eval_reward": 0.5, "eval_loss": 0.0})
            events.append({"event": "run_end", "skipped_steps": 0, "total_steps": 30})
            (run / "loss_scale_log.jsonl").write_text("\n".join(map(json.dumps, events)))
            (run / "run.json").write_text(json.dumps({"returncode": 0}))
    failed = folder / "runs" / "bf16-seed3"  # a run that did not finish: left out
    failed.mkdir()
    (failed / "loss_scale_log.jsonl").write_text(json.dumps({"event": "run_start"}))
    (failed / "run.json").write_text(json.dumps({"returncode": 1}))
    result = grpo.summarize(folder, "python benchmarks/grpo_compare.py", "grpo_test")
    runs = {(r["setting"], r["seed"]): r for r in result["runs"]}
    assert (
        len(runs) == 9 and runs[("fp32", 0)]["steps_to_0.9"] == 18 and runs[("fp32", 0)]["eval_reward"] == 0.5
    )
    assert runs[("bf16", 1)]["mismatch_max"] == pytest.approx(3e-3 + 1e-5)
    assert runs[("dynamic", 0)]["reward_last"] == pytest.approx(0.79)  # steps 6..30 of min(1, step / 20)
    v = result["verdicts"]
    assert v["mismatch_mean"]["bf16-dynamic"]["word"] == "higher (worse)"
    assert v["reward_last"]["bf16-fp32"]["word"] == "no measurable difference"
    assert (
        (tmp_path / "results" / "grpo_test.md")
        .read_text()
        .startswith("Command: `python benchmarks/grpo_compare.py`")
    )


def test_gpu_prepare_carries_the_data_instead_of_trl(tmp_path):
    """`--data` (gpu_check's step 8) leaves TRL out and removes a TRL wheel an earlier run left, so
    the manifest asks for no TRL wheel; without it TRL is asked for. Bug caught: both carried (over
    the 64 MiB limit), or a stale TRL wheel counted into the size."""
    prep = load("gpu_prepare")
    (tmp_path / "trl-1.16.0-py3-none-any.whl").write_bytes(b"x")
    prep.main(["--out", str(tmp_path), "--no-download", "--data"])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert "trl" not in manifest["packages"] and not list(tmp_path.glob("trl-*.whl"))
    prep.main(["--out", str(tmp_path), "--no-download"])
    assert "trl" in json.loads((tmp_path / "manifest.json").read_text())["packages"]


def test_peer_suites_runs_each_suite_twice_and_names_what_fails_only_with_ours(tmp_path):
    """A peer "suite" written here: one test passes in both runs, one only where our scaler is bound (it
    asks for it), one only upstream (it asks for torch's), one fails in both, one skips. Bugs caught:
    the binding not applied in the `ours` child (or applied in both), a regression counted from the
    wrong run, a skipped test counted as ran, the summary file half-written."""
    suite = tmp_path / "test_peer.py"
    suite.write_text(
        "import pytest, torch\n"
        "from accelerate import Accelerator\n"
        "def _scaler():\n"
        "    return type(Accelerator(mixed_precision='fp16', cpu=True).scaler).__name__\n"
        "def test_both(): assert 1 + 1 == 2\n"
        "def test_only_ours(): assert _scaler() == 'DynamicLossScaler'\n"
        "def test_only_upstream(): assert _scaler() != 'DynamicLossScaler'\n"
        "def test_neither(): assert False, 'fails in both'\n"
        "def test_skipped(): pytest.skip('not here')\n"
    )
    out = tmp_path / "summary.json"
    assert load("peer_suites").main(["accelerate", str(suite), "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert (summary["ran"], summary["pass_upstream"], summary["pass_ours"], summary["skipped_upstream"]) == (
        4,
        2,
        2,
        1,
    )
    assert [r["test"].split("::")[-1] for r in summary["pass_upstream_fail_ours"]] == ["test_only_upstream"]
    assert [t.split("::")[-1] for t in summary["fail_upstream_pass_ours"]] == ["test_only_ours"]
    assert not list(tmp_path.glob("*.tmp"))


def test_master_step_ratio_times_both_sides_on_the_same_gradients(tmp_path):
    """The step-ratio benchmark at a tiny size: both sides step (no skip: the gradients are finite and
    FP16-representable), the ratio is the masters' time over FP32's, and the file is whole.
    Bug caught: a side whose step was skipped (it would time nothing), a ratio taken the wrong way up."""
    out = tmp_path / "r.json"
    assert load("master_step_ratio").main(["--width", "64", "--repeats", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted(r["optimizer"] for r in rows) == ["adamw_foreach", "adamw_fused", "sgd"]
    for r in rows:
        assert r["skipped"] == 0 and r["parameters"] == 2 * 64 * 64
        assert r["ratio"] == pytest.approx(r["masters_ms"] / r["fp32_ms"], rel=0.5)  # masters over FP32


@pytest.mark.parametrize("optimizer", ["adamw_fused", "sgd"])
def test_master_step_ratio_gives_every_repeat_the_same_gradients(optimizer):
    """Each timed step of either side starts from the benchmark's gradients as they were: the scaler's
    unscale (SGD) or a fused optimizer's `grad_scale` (fused AdamW) writes the FP32 side's `.grad` in
    place. Bug caught (it was there): the FP32 side stepping on the shared gradient tensor itself, which
    shrank by the scale every step into FP32 subnormals, slowing the baseline several-fold on some
    repeats and making the ratio look better than it is."""
    import torch

    bench = load("master_step_ratio")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        side = bench._side(dtype, 16, 2, optimizer)
        grads = [torch.randn(p.shape, generator=gen) * 2.0**-4 for p in side[0]]
        before = [g.clone() for g in grads]
        for _ in range(3):
            bench._timed_step(*side, grads)
        assert side[2].stats()["skipped_steps"] == 0
        assert all(torch.equal(g, b) for g, b in zip(grads, before, strict=True)), dtype


def test_master_step_ratio_chunked_arm_runs_the_other_path(monkeypatch, tmp_path):
    """`--chunked-arm`: its masters' steps go through the chunked update (torch's fused kernel per
    bucket), the main arm's through the CPU kernel where it builds, and the package's path is back
    afterwards. Bug caught: an A/B whose two arms run the same code (the switch not taking, or left
    switched)."""
    import torch

    from hf_lossscale.masters import cpu_kernel
    from hf_lossscale.masters import step as chunked

    bench = load("master_step_ratio")
    calls = []
    real = chunked.run_chunked
    monkeypatch.setattr(chunked, "run_chunked", lambda *a, **k: calls.append(1) or real(*a, **k))
    import hf_lossscale.masters.optimizer as mw

    monkeypatch.setattr(mw, "run_chunked", chunked.run_chunked)
    side = bench._side(torch.float16, 16, 2, "adamw_fused")
    grads = [torch.randn(p.shape) * 2.0**-4 for p in side[0]]
    bench._timed_step(*side, grads)
    kernel = cpu_kernel.reason() is None
    assert calls == ([] if kernel else [1])
    calls.clear()
    bench._chunked_step(*side, grads)
    assert calls == [1]
    calls.clear()
    bench._timed_step(*side, grads)
    assert calls == ([] if kernel else [1])
    out = tmp_path / "r.json"
    argv = [
        "--width",
        "32",
        "--repeats",
        "3",
        "--optimizers",
        "adamw_fused",
        "--chunked-arm",
        "--json",
        str(out),
    ]
    assert bench.main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["chunked"]["masters_ms"] > 0 and row["ratio_quartiles"][0] <= row["ratio_quartiles"][1]
