"""`hf-lossscale`: the command line.

- `hf-lossscale compare SCRIPT [options] -- SCRIPT_ARGS`: the FP32 / FP16 + dynamic / static / off
  comparison (`hf_lossscale.tools.compare`).
- `hf-lossscale report RUN_DIR`: plots and a summary of a run's `loss_scale_log.jsonl`.
- `hf-lossscale advise --model_name_or_path M --train_file F`: measure gradients, recommend a scale.
- `hf-lossscale underflow --model_name_or_path M --objective clm`: the underflow map (flushed
  gradients against tokens per optimizer step, at scale 1, the settled scale and a static one).
- `hf-lossscale preflight --model_name_or_path M --train_file F`: before training, which modules
  would overflow in FP16 (activations above 65504, or a replayed FP16 forward), the margins in bits,
  the suggested `fp32_modules` and initial scale.
- `hf-lossscale demo [options] [-- RECIPE_ARGS]`: the offline demo (`make demo`): MiniLM-L6 on real text
  under FP32, FP16 with and without scaling and BF16, three seeds, paired verdicts (`hf_lossscale.tools.demo`).
- `hf-lossscale precision --train_file F --model minilm llama`: FP16 and BF16 forwards against FP32 on
  the same weights: the next-token log-probability gap per token (RL's training-inference mismatch).
- `hf-lossscale path [NAME]`: where the installed package keeps the `accelerate` launch configs and
  the small offline sample (`hf_lossscale.tools.packaged`), for the docs' commands without a clone.
"""

from __future__ import annotations

import argparse
import sys


def make_parser() -> argparse.ArgumentParser:
    from .compare import __doc__ as compare_doc
    from .compare import add_compare_arguments

    parser = argparse.ArgumentParser(prog="hf-lossscale", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    compare = commands.add_parser(
        "compare",
        help="Run a training script under FP32 and FP16 with dynamic, static and no loss scaling.",
        description=compare_doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_compare_arguments(compare)

    from .report import __doc__ as report_doc
    from .report import add_report_arguments

    report = commands.add_parser(
        "report", help="Plots and a Markdown summary of a run's loss-scale log.", description=report_doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_report_arguments(report)

    from .advise import __doc__ as advise_doc
    from .advise import add_advise_arguments

    advise = commands.add_parser(
        "advise", help="Measure gradients in a few FP32 steps and recommend a loss scale.", description=advise_doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_advise_arguments(advise)

    from .underflow import __doc__ as underflow_doc
    from .underflow import add_underflow_arguments

    underflow = commands.add_parser(
        "underflow", help="The underflow map: FP16's flushed gradients against tokens per optimizer step.",
        description=underflow_doc, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_underflow_arguments(underflow)

    from .preflight import __doc__ as preflight_doc
    from .preflight import add_preflight_arguments

    preflight = commands.add_parser(
        "preflight", help="Before training: which modules overflow FP16, with margins and suggested fp32_modules.",
        description=preflight_doc, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_preflight_arguments(preflight)

    from .precision import __doc__ as precision_doc
    from .precision import add_precision_arguments

    precision = commands.add_parser(
        "precision", help="FP16 and BF16 forwards against FP32: the next-token log-probability gap per token.",
        description=precision_doc, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_precision_arguments(precision)

    from .packaged import __doc__ as path_doc
    from .packaged import add_path_arguments

    path = commands.add_parser(
        "path", help="Where the package keeps its launch configs and offline sample (for commands without a clone).",
        description=path_doc, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_path_arguments(path)

    from .demo import __doc__ as demo_doc

    # Listed for --help; `main` hands `demo ...` to the demo's own parser (it takes recipe flags after --).
    commands.add_parser("demo", help="The offline demo: FP32 vs FP16 with and without scaling (and BF16), paired verdicts.",
                        description=demo_doc, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:
        from .demo import main as demo_main

        return demo_main(argv[1:], prog="hf-lossscale demo")
    if argv[:1] == ["compare"] and not {"-h", "--help"} & set(argv[1:2]):
        from .compare import main as compare_main

        return compare_main(argv[1:])
    from .compare import split_script_args

    own, script_args = split_script_args(argv)
    parser = make_parser()
    opts = parser.parse_args(own)
    _check_counts(opts)
    if opts.command == "report":
        from .report import make_report

        result = make_report(opts.run_dir, opts.output_dir)
        print(f"Wrote {', '.join(result['written'])} to {result['output_dir']}")
        if result["skipped_lines"]:
            print(f"Skipped {result['skipped_lines']} unreadable line(s) of the event log.")
        return 0
    if opts.command == "advise":
        from .advise import run

        run(opts)
        return 0
    if opts.command == "preflight":
        from .preflight import run as run_preflight

        result = run_preflight(opts)
        # 2: the FP16 forward overflows (a module to move, or the model's own forward / the loss)
        return 2 if result["suggested_fp32_modules"] or result["overflow_outside_modules"] else 0
    if opts.command == "precision":
        from .precision import check
        from .precision import run as run_precision

        check(opts)
        run_precision(opts)
        return 0
    if opts.command == "path":
        from .packaged import run as run_path

        return run_path(opts.name)
    if opts.command == "underflow":
        from .underflow import run as run_underflow

        run_underflow(opts)
        return 0
    raise AssertionError(opts.command)


#: Options that count something (a batch, a step, a block): 0 or less is a mistake, refused by name
#: before a model loads (a batch of 0 divided by zero; `advise --steps -3` said "Not enough text").
_COUNTS = {
    "advise": ("block_size", "per_device_train_batch_size", "gradient_accumulation_steps", "steps"),
    "preflight": ("block_size", "per_device_train_batch_size", "gradient_accumulation_steps", "steps",
                  "max_modules"),
    "precision": ("block_size", "eval_blocks", "train_blocks", "batch_size"),
}  # fmt: skip


def _check_counts(opts: argparse.Namespace) -> None:
    for name in _COUNTS.get(opts.command, ()):
        value = getattr(opts, name, None)
        if value is not None and value < 1:
            raise SystemExit(f"--{name} {value}: {opts.command} needs at least 1.")


if __name__ == "__main__":
    sys.exit(main())
