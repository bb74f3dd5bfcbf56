"""Tiny models and data built from configs (no download)."""

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


def tiny_mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
