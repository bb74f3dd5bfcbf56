"""`hf-lossscale`: the command line. `hf-lossscale compare SCRIPT [options] -- SCRIPT_ARGS` runs the
FP32 / FP16 + dynamic / static / off comparison (see `hf_lossscale.compare`)."""

from __future__ import annotations

import argparse
import shlex
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
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from .compare import split_script_args

    own, script_args = split_script_args(argv)
    opts = make_parser().parse_args(own)
    if opts.command == "compare":
        from .compare import run_comparison

        opts.script_args = script_args
        opts.command_line = shlex.join(["hf-lossscale", *argv])
        results, _ = run_comparison(opts)
        return 1 if any(r.status == "failed" for r in results) else 0
    raise AssertionError(opts.command)


if __name__ == "__main__":
    sys.exit(main())
