"""`hf-lossscale underflow`: the underflow map. Which gradients FP16 throws away, and how that
grows with the tokens per optimizer step, measured without training.

For each point `MICRO x BLOCK x ACCUM` (micro-batch of MICRO sequences of BLOCK tokens, ACCUM
micro-batches per optimizer step; `/D` after it divides the loss by D more, which is the per-token
gradient scale of a step with D times more tokens), one optimizer step's gradient is computed twice on the same
batches: in FP32 (the reference, with this point's own loss divisor ACCUM: a reference made for one
divisor is not the reference for another) and in emulated FP16 (`fp16_emulation(policy="cuda")`,
each micro-batch its own backward, as accumulation does) at each scale: 1 (no loss scaling), the
largest power of two at which the step does not overflow (where dynamic scaling settles: it grows
until it overflows and backs off once), and a chosen static scale. Reported: the fraction of the
non-zero FP32 gradient elements that come out zero (overall, per module, and the LM head / word
embeddings apart from the rest) and the relative error `||g16 / scale - g32|| / ||g32||`.

Writes `underflow.json`, `underflow.md` (the table) and `underflow.png` to `--output_dir`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..fp16.underflow import DEFAULT_POINTS, underflow_map

__all__ = ["add_underflow_arguments", "run", "format_row", "format_table", "write_plot"]


def add_underflow_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model_name_or_path", required=True, help="A local model folder or a Hub id.")
    parser.add_argument("--objective", choices=["clm", "mlm", "cls"], default="clm",
                        help="Causal LM, masked LM, or sequence classification (a fresh 2-label head).")  # fmt: skip
    parser.add_argument("--train_file", default=None,
                        help="Text (clm/mlm: one text per line; cls: a TSV/CSV with a header naming `sentence` "
                        "and `label`, e.g. SST-2's train.tsv). Default: the Python documentation's topic pages "
                        "(pydoc_data; for cls with alternating labels).")  # fmt: skip
    parser.add_argument("--points", default=DEFAULT_POINTS,
                        help="Space- or comma-separated MICROxBLOCKxACCUM points (sequences per micro-batch, "
                        "tokens per sequence, micro-batches per optimizer step); MICROxBLOCKxACCUM/D also divides "
                        "the loss by D: the per-token gradients of a step with D times more tokens.")  # fmt: skip
    parser.add_argument("--static_scale", type=float, default=2.0**24, help="The static scale measured too.")
    parser.add_argument("--max_scale", type=float, default=2.0**24,
                        help="The largest scale the search for the settled scale tries (the scaler's max).")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", default="underflow_out")


def run(opts: argparse.Namespace) -> dict[str, Any]:
    """The command: measure the map (each point's line printed as it is measured), write its JSON,
    table and figure to `opts.output_dir`, print the table."""
    out = Path(opts.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        result = underflow_map(
            opts.model_name_or_path, objective=opts.objective, train_file=opts.train_file, points=opts.points,
            static_scale=opts.static_scale, max_scale=opts.max_scale, seed=opts.seed,
            on_row=lambda row: print(format_row(row), flush=True),
        )  # fmt: skip
    except ValueError as err:  # the options or the text: said as the command always said it
        raise SystemExit(str(err)) from None
    table = format_table(result)
    (out / "underflow.json").write_text(json.dumps(result, indent=1))
    (out / "underflow.md").write_text(table)
    write_plot([result], out / "underflow.png")
    print(table)
    print(f"Wrote {out / 'underflow.json'}, {out / 'underflow.md'}, {out / 'underflow.png'}")
    return result


def _pct(x: float | None) -> str:
    from .summary import percent

    return "—" if x is None else percent(x)


def _tokens(row: dict[str, Any]) -> str:
    """Tokens per step; for a `/D` point, the step it stands for (D x the tokens it holds)."""
    divisor = row.get("loss_divisor", 1)
    held = f"{row['tokens']:,}"
    return held if divisor == 1 else f"{row['tokens'] * divisor:,} ({held} x {divisor})"


def _cell(m: dict[str, Any]) -> str:
    if m["overflow"]:
        return "overflow"
    return (
        f"{_pct(m['flushed_fraction'])} (head {_pct(m['flushed_head'])}), err {m['relative_grad_error']:.2g}"
    )


def format_row(row: dict[str, Any]) -> str:
    """One point's line, as the command prints it while the map is measured."""
    from .summary import scale_text

    return (
        f"{row['point']:>10} {_tokens(row):>7} tokens | scale 1: {_cell(row['at_1'])} | settled "
        f"{scale_text(row['settled_scale'])}: {_cell(row['at_settled'])} | static "
        f"{scale_text(row['at_static']['scale'])}: {_cell(row['at_static'])}"
    )


def format_table(result: dict[str, Any]) -> str:
    """The map as a Markdown table."""
    from .summary import scale_text

    static = scale_text(result["static_scale"])
    model = Path(result["model"])
    model_name = model.parent.name if model.name == "model" else model.name  # pip packages' model/ folder
    data = "/".join(Path(result["data"]).parts[-2:]) if "/" in result["data"] else result["data"]
    lines = [
        f"Underflow map: `{model_name}`, {result['objective']}, data `{data}`; "
        "emulated FP16 (policy cuda). Flushed = non-zero FP32 gradient elements that are zero in FP16 "
        "(head = LM head / word embeddings, rest = every other parameter); err = ||g16/scale - g32|| / ||g32||.",
        "",
        "| micro x block x accum | tokens / step | flushed @1 | head @1 | rest @1 | err @1 | settled scale "
        f"| flushed @settled | err @settled | @{static} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        one, settled, st = r["at_1"], r["at_settled"], r["at_static"]
        lines.append(
            f"| {r['point']} | {_tokens(r)} | {_pct(one['flushed_fraction'])} | {_pct(one['flushed_head'])} | "
            f"{_pct(one['flushed_rest'])} | {one['relative_grad_error']:.2g} | {scale_text(r['settled_scale'])} | "
            f"{_pct(settled['flushed_fraction'])} | {settled['relative_grad_error']:.2g} | "
            f"{'overflow' if st['overflow'] else _pct(st['flushed_fraction'])} |"
        )
    return "\n".join(lines) + "\n"


def write_plot(results: list[dict[str, Any]], path: Path) -> None:
    """Flushed fraction and relative error against tokens per step, one colour per objective."""
    from .._extras import need

    matplotlib = need("matplotlib", "The underflow map's plot", "tools")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = ["tab:orange", "tab:blue", "tab:green", "tab:red", "tab:purple"]
    for color, result in zip(colors, results):
        rows = sorted(result["rows"], key=lambda r: r["tokens"] * r.get("loss_divisor", 1))
        x = [r["tokens"] * r.get("loss_divisor", 1) for r in rows]
        name = result.get("label", result["objective"])
        left.plot(
            x,
            [100 * r["at_1"]["flushed_fraction"] for r in rows],
            "o-",
            color=color,
            label=f"{name}: all, scale 1",
        )
        left.plot(x, [100 * (r["at_1"]["flushed_head"] or 0) for r in rows], "s--", color=color, alpha=0.6,
                  label=f"{name}: LM head / embeddings, scale 1")  # fmt: skip
        left.plot(x, [100 * r["at_settled"]["flushed_fraction"] for r in rows], "^:", color=color,
                  label=f"{name}: all, settled scale")  # fmt: skip
        right.plot(
            x, [r["at_1"]["relative_grad_error"] for r in rows], "o-", color=color, label=f"{name}: scale 1"
        )
        right.plot(x, [r["at_settled"]["relative_grad_error"] for r in rows], "^:", color=color,
                   label=f"{name}: settled scale")  # fmt: skip
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per optimizer step")
        ax.legend(fontsize=7)
    left.set_ylabel("gradient elements flushed to zero (%)")
    left.set_title("What FP16 throws away")
    right.set_yscale("log")
    right.set_ylabel("relative gradient error")
    right.set_title("||g16/scale - g32|| / ||g32||")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
