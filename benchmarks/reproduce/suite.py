"""The reproduced benchmarks, defined once: what each fine-tunes, its recipe arguments and its
settings. `run.py` runs them and `table.py` renders their results; both import this module, and
neither imports the other's.
"""

from __future__ import annotations

COMMON = [
    "--report_to", "none",
    "--disable_tqdm", "true",
    "--save_strategy", "no",
    "--dataloader_num_workers", "0",
]  # fmt: skip

#: name -> what it runs. `steps` is the full run; `quick` the CI subset's runner and recipe flags.
BENCHMARKS: dict[str, dict] = {
    "sst2": {
        "what": "GLUE SST-2, MiniLM-L6 sequence classification, one epoch (67,349 rows / batch 32)",
        "recipe": "recipes/text_classification.py",
        "settings": "fp32,dynamic,off",
        "steps": 2105,
        "seeds": [0, 1, 2],
        "data": ["--train_file", "{data}/sst2/train.tsv", "--validation_file", "{data}/sst2/validation.tsv"],
        "args": [
            "--per_device_train_batch_size",
            "32",
            "--per_device_eval_batch_size",
            "128",
            "--learning_rate",
            "5e-5",
            "--weight_decay",
            "0.01",
            "--warmup_steps",
            "126",
            "--max_seq_length",
            "128",
            "--train_sampling_strategy",
            "group_by_length",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "500",
        ],  # fmt: skip
        "quick": {
            "steps": 6,
            "args": ["--per_device_train_batch_size", "8", "--max_eval_samples", "64", "--eval_steps", "3"],
        },  # fmt: skip
    },
}


def _lm(
    data: list[str],
    objective: str,
    what: str,
    *,
    batch: int = 2,
    accumulation: int = 8,
    steps: int = 100,
    eval_steps: int = 10,
    learning_rate: str = "2e-4",
) -> dict:
    """A language-model benchmark: 128-token blocks, `batch x accumulation` blocks per optimizer step."""
    return {
        "what": f"{what}, {128 * batch * accumulation:,} tokens per optimizer step, {steps} steps",
        "recipe": "recipes/language_modeling.py",
        "settings": "fp32,dynamic,off",
        "steps": steps,
        "seeds": [0, 1, 2],
        "data": data,
        "args": [
            "--objective",
            objective,
            "--block_size",
            "128",
            "--per_device_train_batch_size",
            str(batch),
            "--gradient_accumulation_steps",
            str(accumulation),
            "--per_device_eval_batch_size",
            "16",
            "--max_eval_samples",
            "96",
            "--learning_rate",
            learning_rate,
            "--warmup_steps",
            str(max(2, steps // 10)),
            "--eval_strategy",
            "steps",
            "--eval_steps",
            str(eval_steps),
        ],  # fmt: skip
        "quick": {
            "steps": 3,
            "args": [
                "--per_device_train_batch_size",
                "1",
                "--gradient_accumulation_steps",
                "2",
                "--max_eval_samples",
                "8",
                "--eval_steps",
                "3",
            ],
        },  # fmt: skip
    }


_SHAKESPEARE = ["--train_file", "{data}/tinyshakespeare/input.txt", "--validation_split_percentage", "5"]
_WIKITEXT = ["--train_file", "{data}/wikitext2/valid.txt", "--validation_file", "{data}/wikitext2/test.txt"]
for _name, _data, _corpus in (("shakespeare", _SHAKESPEARE, "tiny-shakespeare (last 5% of lines held out)"),
                              ("wikitext2", _WIKITEXT, "WikiText-2 (valid as train, test as eval)")):  # fmt: skip
    BENCHMARKS[f"{_name}-mlm"] = _lm(_data, "mlm", f"{_corpus}, MiniLM-L6 masked LM")
    BENCHMARKS[f"{_name}-clm"] = _lm(_data, "clm", f"{_corpus}, MiniLM-L6 as a causal LM (is_decoder)")
# GPU scale: 16,384 tokens per optimizer step (8x the above), where FP16 flushes most of the LM head's gradient.
BENCHMARKS["shakespeare-clm-16k"] = _lm(
    _SHAKESPEARE,
    "clm",
    "tiny-shakespeare, MiniLM-L6 as a causal LM",
    batch=4,
    accumulation=32,
    steps=30,
    eval_steps=5,
)


#: A small decoder trained from scratch (random weights, MiniLM's 30,522-token vocabulary): where the
#: classic account says FP16 without scaling "stalls or diverges". Built once, from this config.
SCRATCH = {"n_layer": 2, "n_embd": 128, "n_head": 2, "n_positions": 128}
BENCHMARKS["shakespeare-scratch"] = {
    **_lm(
        _SHAKESPEARE,
        "clm",
        "tiny-shakespeare, a 2-layer 128-wide GPT-2 trained from scratch",
        batch=8,
        accumulation=4,
        steps=200,
        eval_steps=20,
        learning_rate="1e-3",
    ),  # fmt: skip
    "model": "scratch",
}

#: GPU scale by simulation: the from-scratch benchmark with every backward gradient divided by 32 or
#: 256 (`--loss_divisor`, which divides AdamW's epsilon and the clip threshold with it): the per-token
#: gradients of 2^17 or 2^20 tokens per optimizer step, on the same 4,096 tokens and the same FP32
#: updates. FP32 is run too: it measures what the divisor itself changes (only the clip's 1e-6 term).
for _tag, _divisor in (("128k", 32), ("1m", 256)):
    BENCHMARKS[f"shakespeare-scratch-{_tag}"] = {
        **BENCHMARKS["shakespeare-scratch"],
        "what": "tiny-shakespeare, the 2-layer 128-wide GPT-2 from scratch, 4,096 tokens per optimizer step "
        f"with gradients divided by {_divisor} (the per-token gradient scale of {4096 * _divisor:,} tokens "
        "per step), 200 steps",
        "args": [*BENCHMARKS["shakespeare-scratch"]["args"], "--loss_divisor", str(_divisor)],
        "settings": "fp32,off,dynamic",
        # judged against that benchmark's FP32 runs (the same updates); its own FP32 runs measure that
        "fp32_from": "shakespeare-scratch",
    }
