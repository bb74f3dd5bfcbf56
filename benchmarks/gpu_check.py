"""The CUDA-only check of `gpu_check.sh` that is not a test: `fp16_emulation(policy="cuda")`
against real CUDA autocast (the no-sync checks are CUDA tests, which `gpu_check.sh` runs first):

1. per op: the output dtype of every sample in `tests/autocast_ops.py` under real CUDA autocast
   against the emulation's FP16 tag, with FP32, FP16 and mixed inputs;
2. per architecture (MiniLM-L6 masked LM, GPT-2, Llama-style, T5; `benchmarks/emulation_fidelity.py`):
   flushed fraction, relative gradient error and overflow, real against emulated, at loss
   divisors 1 / 16 / 64 and scales 1 / 2^8; and with a residual stream near 300, real and
   emulated loss and overflow.

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
        fid = _load(Path(__file__).parent / "emulation_fidelity.py", "emulation_fidelity")
        model = BertForMaskedLM.from_pretrained(fid.minilm_path())
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


def _load(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_ops(device: str = "cuda") -> dict:
    """Real CUDA autocast's output dtype against the emulation's tag, op by op (`device="cpu"`:
    the same code against CPU autocast, for a dry run without a GPU)."""
    from hf_lossscale import fp16_emulation

    root = Path(__file__).resolve().parents[1]
    samples = _load(root / "tests" / "autocast_ops.py", "autocast_ops").SAMPLES

    def run(fn, inputs, context):
        g = torch.Generator().manual_seed(0)
        a, b = (torch.randn(4, 8, generator=g).to(device) for _ in range(2))
        with context:
            x = torch.nn.functional.linear(a, torch.eye(8, device=device)) if inputs != "fp32" else a
            y = torch.nn.functional.linear(b, torch.eye(8, device=device)) if inputs == "fp16" else b
            return fn(x, y)

    rows, mismatches = [], []
    for name, fn in sorted(samples.items()):
        for inputs in ("fp32", "fp16", "mixed"):
            try:
                real = run(fn, inputs, torch.autocast(device, dtype=torch.float16)).dtype == torch.float16
            except Exception as err:  # noqa: BLE001 - a refusal is a finding, not a failure
                rows.append({"op": name, "inputs": inputs, "real": f"refused: {str(err)[:60]}"})
                continue
            emulated = bool(getattr(run(fn, inputs, fp16_emulation("cuda")), "_hf_fp16", False))
            rows.append({"op": name, "inputs": inputs, "real_fp16": real, "emulated_fp16": emulated})
            if real != emulated:
                mismatches.append(
                    f"{name}/{inputs}: CUDA {'FP16' if real else 'FP32'}, emulated {'FP16' if emulated else 'FP32'}"
                )
    return {
        "ok": not mismatches,
        "checked": sum("real_fp16" in r for r in rows),
        "mismatches": mismatches,
        "rows": rows,
    }


def check_architectures(tiny: bool, device: str = "cuda") -> dict:
    fid = _load(Path(__file__).parent / "emulation_fidelity.py", "emulation_fidelity")
    rows, large = [], {}
    for arch in ("gpt2", "llama", "t5") if tiny else ("mlm", "gpt2", "llama", "t5"):
        model = fid.build(arch).to(device).eval()
        data = {
            k: v.to(device)
            for k, v in fid.text_batch(model, arch, 2 if tiny else 4, 16 if tiny else 64).items()
        }
        for divisor in (1, 16, 64):
            for scale in (1.0, 2.0**8):
                real = measure_flushed_fraction(
                    model, data, fp16="native", policy="cuda", loss_divisor=divisor, scale=scale
                )
                emulated = measure_flushed_fraction(model, data, fp16="emulate", policy="cuda", loss_divisor=divisor,
                                                    scale=scale, reference=real["reference"])  # fmt: skip
                rows.append({
                    "arch": arch, "divisor": divisor, "scale": scale,
                    "flushed_cuda": real["flushed_fraction"], "flushed_emulated": emulated["flushed_fraction"],
                    "rel_err_cuda": real["relative_grad_error"], "rel_err_emulated": emulated["relative_grad_error"],
                    "overflow_cuda": real["overflow"], "overflow_emulated": emulated["overflow"],
                })  # fmt: skip
        if arch != "mlm":
            emb = model.get_input_embeddings()
            with torch.no_grad():
                factor = 300.0 / emb(data["input_ids"]).abs().mean().item()
            handle = emb.register_forward_hook(lambda module, args, out, f=factor: out * f)
            try:
                real = measure_flushed_fraction(model, data, fp16="native", policy="cuda")
                emulated = measure_flushed_fraction(
                    model, data, fp16="emulate", policy="cuda", reference=real["reference"]
                )
            finally:
                handle.remove()
            large[arch] = {"overflow_cuda": real["overflow"], "overflow_emulated": emulated["overflow"]}
    ok = all(abs(r["flushed_cuda"] - r["flushed_emulated"]) <= 0.005 and r["overflow_cuda"] == r["overflow_emulated"]
             for r in rows) and all(v["overflow_cuda"] == v["overflow_emulated"] for v in large.values())  # fmt: skip
    return {"ok": ok, "rows": rows, "large_activations": large}


def table(result: dict) -> str:
    lines = ["| model | /divisor, scale | flushed CUDA / emulated | rel. grad error CUDA / emulated | overflow CUDA / emulated |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in result["architectures"]["rows"]:
        lines.append(
            f"| {r['arch']} | /{r['divisor']}, {r['scale']:g} | {r['flushed_cuda']:.4f} / {r['flushed_emulated']:.4f} | "
            f"{r['rel_err_cuda']:.4f} / {r['rel_err_emulated']:.4f} | {r['overflow_cuda']} / {r['overflow_emulated']} |"
        )
    ops = result["ops"]
    lines.append(f"\nOps: {ops['checked']} (op, inputs) cases checked, {len(ops['mismatches'])} mismatches"
                 + (": " + "; ".join(ops["mismatches"]) if ops["mismatches"] else ""))  # fmt: skip
    return "\n".join(lines)


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
    result["ops"] = check_ops()
    result["architectures"] = check_architectures(opts.tiny)
    Path(opts.output).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.output).write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result["emulation_vs_cuda"], indent=2, default=str))
    print(table(result))
    ok = result["emulation_vs_cuda"]["ok"] and result["ops"]["ok"] and result["architectures"]["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
