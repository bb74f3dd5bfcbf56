"""`hf-lossscale precision`: the FP16/BF16 log-probability gap to FP32."""

import json
import math

import pytest
import torch
from tiny_models import save_tiny_bert

from hf_lossscale.fp16.precision import logprob_gap


def tiny_llama(seed=0, vocab=96):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def blocks(n=3, t=16, vocab=96, seed=1):
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


def test_gap_matches_a_per_position_recomputation():
    """The figures equal a direct, position-by-position computation: log p of token t+1 from the
    logits at t, under FP32 and under BF16 autocast. Bug caught: targets shifted by one (the gap
    of the wrong token), or the KL taken the wrong way round."""
    model, ids = tiny_llama(), blocks()
    got = logprob_gap(model, ids, precisions=("bf16",), batch_size=2)["bf16"]
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=ids).logits.double(), -1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = torch.log_softmax(model(input_ids=ids).logits.double(), -1)
    deltas, kls, changed = [], [], 0
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            nxt = ids[b, t + 1]
            deltas.append(abs(float(low[b, t, nxt] - ref[b, t, nxt])))
            kls.append(float((ref[b, t].exp() * (ref[b, t] - low[b, t])).sum()))
            changed += int(low[b, t].argmax() != ref[b, t].argmax())
    n = len(deltas)
    assert got["tokens"] == n and got["nonfinite_tokens"] == 0
    assert got["mean_abs_delta_logp"] == pytest.approx(sum(deltas) / n, rel=1e-5)
    assert got["max_abs_delta_logp"] == pytest.approx(max(deltas), rel=1e-5)
    assert got["mean_kl"] == pytest.approx(sum(kls) / n, rel=1e-4, abs=1e-12)
    assert got["argmax_changed"] == changed / n


def test_bf16_moves_log_probs_further_than_fp16():
    """7 mantissa bits against 10: BF16's gap is several times FP16's (the rounding unit is 8x), and
    both are non-zero. Bug caught: a context that did not apply (a gap of exactly 0), or FP16 and
    BF16 swapped."""
    gap = logprob_gap(tiny_llama(), blocks(n=4, t=32))
    assert gap["fp16"]["mean_abs_delta_logp"] > 0
    assert gap["bf16"]["mean_abs_delta_logp"] > 3 * gap["fp16"]["mean_abs_delta_logp"]
    assert gap["bf16"]["mean_kl"] > gap["fp16"]["mean_kl"] > 0


def test_an_fp16_overflow_is_counted_not_averaged():
    """Logits beyond 65504 under FP16 give non-finite log-probabilities: counted as such, and the
    means stay finite. Bug caught: NaN means that hide the overflow."""
    model = tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(1e6)
    gap = logprob_gap(model, blocks())
    assert gap["fp16"]["nonfinite_tokens"] > 0
    assert all(math.isfinite(v) for v in gap["fp16"].values())
    assert gap["bf16"]["nonfinite_tokens"] == 0  # BF16 has FP32's range


def test_precision_command_writes_table_json_and_plot(tmp_path):
    from hf_lossscale.tools.cli import main

    model = save_tiny_bert(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"line {i} of the loss scale story, with small gradients" for i in range(400)))
    out = tmp_path / "out"
    args = ["precision", "--train_file", str(text), "--model", model, "--block_size", "16",
            "--eval_blocks", "2", "--train_blocks", "4", "--finetune_steps", "2", "--output_dir", str(out)]  # fmt: skip
    assert main(args) == 0
    result = json.loads((out / "precision.json").read_text())
    stages = result["models"][0]["stages"]
    assert [s["stage"].split(" (")[0] for s in stages] == ["initialisation", "after 2 FP32 steps"]
    assert set(stages[0]["gap"]) == {"fp16", "bf16"} and stages[0]["gap"]["fp16"]["tokens"] == 2 * 15
    table = (out / "precision.md").read_text()
    assert table.count("| BF16 |") == 2 and table.count("| FP16 |") == 2
    assert (out / "precision.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="block_size must be at least 2"):
        main([*args[:5], "--block_size", "1"])
