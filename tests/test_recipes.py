"""The recipes: --help, --config files, column detection, and short real runs offline."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from benchmark_data import DATA, needs_data
from tiny_models import minilm_path, save_tiny_bert

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ["text_classification", "language_modeling"]


def load_recipe(name):
    return importlib.import_module(f"hf_lossscale.recipes.{name}")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def shared(*parts):
    path = DATA.joinpath(*parts)
    if not path.exists():
        pytest.fail(
            f"{path} is missing: the tests read HF_LOSSSCALE_DATA (default ../shared/data; see its README)."
        )
    return str(path)


@pytest.mark.parametrize("name", RECIPES)
def test_help_lists_every_flag(name, capsys):
    from hf_lossscale.integrations.trainer import ARG_TO_FIELD

    module = load_recipe(name)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "accelerate launch" in text  # the docstring with the exact command
    for flag in ["--config", "--model_name_or_path", "--train_file", "--dataset_name", "--loss_scale_measure_flushed",
                 *(f"--{a}" for a in ARG_TO_FIELD)]:  # fmt: skip
        assert flag in text, flag


def test_compare_entry_points_help(capsys):
    from hf_lossscale.tools.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--help"])
    assert exit_info.value.code == 0
    cli_help = capsys.readouterr().out
    assert "--static_scale" in cli_help
    # the recipe's entry point is the same command: its --help is the CLI's, and it refuses what the
    # CLI refuses. Bug caught: recipes/compare.py drifting into a second runner with other options.
    import subprocess

    recipe = subprocess.run([sys.executable, str(ROOT / "recipes" / "compare.py"), "--help"],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert recipe.returncode == 0 and "--static_scale" in recipe.stdout
    assert recipe.stdout.split("options:")[1] == cli_help.split("options:")[1]
    bad = subprocess.run([sys.executable, str(ROOT / "recipes" / "compare.py"), "nope.py", "--settings", "fp32,fp8"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode != 0 and "fp8" in bad.stderr


def test_config_file_sets_defaults_and_flags_win(tmp_path):
    from hf_lossscale import LossScaleTrainingArguments
    from hf_lossscale.recipes.recipe_args import make_parser, parse_args

    config = tmp_path / "run.yaml"
    config.write_text(
        "output_dir: out\nmax_steps: 7\nfp16: true\nloss_scale_mode: static\nloss_scale_init: 1024\n"
    )
    (args,) = parse_args(
        make_parser(LossScaleTrainingArguments), ["--config", str(config), "--max_steps", "9"]
    )
    assert (args.max_steps, args.fp16, args.loss_scale_mode, args.loss_scale_init) == (
        9,
        True,
        "static",
        1024.0,
    )


@pytest.mark.parametrize(
    "text, match",
    [
        ("max_stepz: 7\n", r"unknown keys \['max_stepz'\]"),
        ("- a\n- b\n", "must hold a mapping"),
        ("max_steps: abc\n", r"max_steps='abc'"),
        ("max_steps: 2.5\n", "not an integer"),
        ("learning_rate: [1]\n", "not a number"),
        ("objective: xlm\n", r"objective='xlm' is not one of \['mlm', 'clm'\]"),
        ("loss_scale_mode: fast\n", "loss_scale_mode"),
        ("max_steps: [\n", "Cannot parse recipe config file"),
    ],
)
def test_config_file_errors_name_the_problem(tmp_path, text, match):
    module = load_recipe("language_modeling")
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(ValueError, match=match):
        module.main(["--config", str(config), "--model_name_or_path", "m", "--train_file", "t.txt"])


def test_unreadable_config_file_is_named(tmp_path):
    module = load_recipe("text_classification")
    with pytest.raises(ValueError, match="Cannot read recipe config file .*missing.yaml"):
        module.main(["--config", str(tmp_path / "missing.yaml")])


def test_text_columns_as_run_glue_picks_them():
    from datasets import Dataset

    module = load_recipe("text_classification")
    args = module.DataTrainingArguments(train_file="x.csv")
    pair = Dataset.from_dict({"idx": [0], "sentence1": ["a"], "sentence2": ["b"], "label": [1]})
    assert module.text_columns(args, pair) == ("sentence1", "sentence2")
    single = Dataset.from_dict({"idx": [0], "sentence": ["a"], "label": [1]})
    assert module.text_columns(args, single) == ("sentence", None)
    two_texts = Dataset.from_dict({"title": ["t"], "body": ["b"], "label": [1]})
    with pytest.raises(ValueError, match="--text_column_names"):
        module.text_columns(args, two_texts)
    args.text_column_names = "title,body"
    assert module.text_columns(args, two_texts) == ("title", "body")
    args.text_column_names = "title,nope"
    with pytest.raises(ValueError, match="missing"):
        module.text_columns(args, two_texts)
    glue = module.DataTrainingArguments(dataset_name="nyu-mll/glue", dataset_config_name="qnli")
    qnli = Dataset.from_dict({"question": ["q"], "sentence": ["s"], "idx": [0], "label": [1]})
    assert module.text_columns(glue, qnli) == ("question", "sentence")
    with pytest.raises(ValueError, match=r"--task_name qnli: its text columns \['question', 'sentence'\]"):
        module.text_columns(glue, pair)


def events(output_dir):
    from hf_lossscale.core.events import read_run_events

    return read_run_events(Path(output_dir) / "loss_scale_log.jsonl")


@needs_data
def test_text_classification_sst2_real_minilm(tmp_path):
    """The real pretrained MiniLM on real SST-2 rows, FP16 emulated, offline metric modules."""
    module = load_recipe("text_classification")
    out = tmp_path / "sst2"
    metrics = module.main([
        "--do_train", "--do_eval",
        "--model_name_or_path", minilm_path(),
        "--train_file", shared("sst2", "train.tsv"), "--validation_file", shared("sst2", "validation.tsv"),
        "--max_train_samples", "32", "--max_eval_samples", "16", "--max_seq_length", "32",
        "--output_dir", str(out), "--fp16", "--max_steps", "2", "--per_device_train_batch_size", "8",
        "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", "--disable_tqdm", "true",
        "--loss_scale_init", "1024",
    ])  # fmt: skip
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0 and metrics["eval_samples"] == 16
    assert json.loads((out / "eval_results.json").read_text())["eval_accuracy"] == metrics["eval_accuracy"]
    run = events(out)
    assert run[0]["fp16"] == "emulated" and run[0]["loss_scale_config"]["init_scale"] == 1024.0
    assert sum(e.get("event") == "log" and "loss" in e for e in run) == 2


def test_text_classification_pairs_and_f1(tmp_path, tiny_model):
    rows = [("a good film", "it was good", 1), ("a bad film", "it was awful", 0)] * 8
    for split in ("train", "validation"):
        (tmp_path / f"{split}.csv").write_text(
            "sentence1,sentence2,label\n" + "".join(f"{a},{b},{c}\n" for a, b, c in rows)
        )
    module = load_recipe("text_classification")
    metrics = module.main([
        "--do_train", "--do_eval", "--model_name_or_path", tiny_model,
        "--train_file", str(tmp_path / "train.csv"), "--validation_file", str(tmp_path / "validation.csv"),
        "--metric_names", "accuracy,f1,matthews_correlation",
        "--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--per_device_train_batch_size", "4",
        "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
    ])  # fmt: skip
    assert {"eval_accuracy", "eval_f1", "eval_matthews_correlation"} <= set(metrics)


@needs_data
@pytest.mark.parametrize("objective", ["mlm", "clm"])
def test_language_modeling_runs_and_reports_perplexity(tmp_path, tiny_model, objective):
    module = load_recipe("language_modeling")
    out = tmp_path / objective
    metrics = module.main([
        "--do_train", "--do_eval", "--model_name_or_path", tiny_model, "--objective", objective,
        "--train_file", shared("wikitext2", "valid.txt"), "--validation_file", shared("wikitext2", "test.txt"),
        "--block_size", "32", "--max_train_samples", "64", "--max_eval_samples", "8",
        "--output_dir", str(out), "--fp16", "--max_steps", "3", "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "2", "--report_to", "none", "--save_strategy", "no",
        "--logging_steps", "1", "--disable_tqdm", "true", "--loss_scale_measure_flushed",
    ])  # fmt: skip
    # The perplexity reported is the final evaluation's: the eval loss in the Trainer's own log (the
    # event log), exponentiated, and no better than uniform over the vocabulary. Bug caught: a
    # perplexity from a stale or partial evaluation, or from the training loss.
    final_eval = [e for e in events(out) if e["event"] == "log" and "eval_loss" in e][-1]
    assert math.log(metrics["perplexity"]) == pytest.approx(final_eval["eval_loss"], rel=1e-6)
    assert 1.0 < metrics["perplexity"] < 30522 * 1.5
    probes = [e for e in events(out) if e["event"] == "flushed_probe"]
    assert [p["when"] for p in probes] == ["start", "end"] and probes[0]["loss_divisor"] == 2
    # The logged loss is the mean over the accumulated micro-batches, not their sum (x2): about
    # ln(vocabulary) for an untrained head, in both objectives.
    first = next(e["loss"] for e in events(out) if e["event"] == "log" and "loss" in e)
    assert 0.7 < first / math.log(30522) < 1.4, first
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(out).is_decoder is (objective == "clm")


def test_mlm_evaluation_masks_the_same_tokens_every_time(tmp_path, tiny_model):
    from datasets import Dataset
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling

    module = load_recipe("language_modeling")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    blocks = Dataset.from_dict({"input_ids": [list(range(1000, 1032))] * 8})
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3)
    a = module.mask_once(blocks, collator, seed=3)
    b = module.mask_once(blocks, collator, seed=3)
    assert a["labels"] == b["labels"] and any(x != -100 for row in a["labels"] for x in row)
    batch = module._EvalFixedMasking(collator)([a[0], a[1]])
    assert batch["labels"].tolist() == [a[0]["labels"], a[1]["labels"]]


@pytest.mark.parametrize("eval_steps", [3, 2])
def test_final_evaluation_is_not_repeated(tmp_path, tiny_model, eval_steps):
    """With a periodic evaluation at the last step, the recipe reports it instead of evaluating the
    same model again; when the last periodic one came earlier, it evaluates the final model."""
    module = load_recipe("language_modeling")
    text = tmp_path / "text.txt"
    text.write_text(
        "\n".join(f"line {i} of the loss scaling text, with a few more words" for i in range(200))
    )
    out = tmp_path / "out"
    metrics = module.main([
        "--do_train", "--do_eval", "--model_name_or_path", tiny_model, "--objective", "clm",
        "--train_file", str(text), "--validation_split_percentage", "10", "--block_size", "32",
        "--output_dir", str(out), "--max_steps", "3", "--per_device_train_batch_size", "2",
        "--eval_strategy", "steps", "--eval_steps", str(eval_steps), "--max_eval_samples", "4",
        "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
    ])  # fmt: skip
    evals = [e for e in events(out) if e["event"] == "log" and "eval_loss" in e]
    assert [e["step"] for e in evals] == ([3] if eval_steps == 3 else [2, 3])
    assert metrics["eval_loss"] == evals[-1]["eval_loss"]


def _train_tiny_clm(module, tiny_model, text, out, *extra):
    module.main([
        "--do_train", "--model_name_or_path", tiny_model, "--objective", "clm",
        "--train_file", str(text), "--validation_split_percentage", "10", "--block_size", "32",
        "--output_dir", str(out), "--max_steps", "4", "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3", "--report_to", "none",
        "--save_strategy", "no", "--disable_tqdm", "true", "--logging_steps", "1", *extra,
    ])  # fmt: skip
    from safetensors.torch import load_file

    return load_file(out / "model.safetensors"), [e for e in events(out) if e["event"] == "log"]


def test_loss_divisor_leaves_fp32_training_bitwise_unchanged(tmp_path, tiny_model):
    """--loss_divisor 256 divides the gradients, AdamW's epsilon and the clip threshold by 256: in
    FP32 the weights after 4 steps are bitwise those of the undivided run and the logged loss is the
    same, while the logged grad norm is 256x smaller. Bugs caught: epsilon or max_grad_norm left
    undivided (Adam's update changes), the logged loss divided too, a divisor that never reaches
    the gradients (grad norms equal)."""
    module = load_recipe("language_modeling")
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"line {i} of a short text about loss scaling in FP16" for i in range(300)))
    # max_grad_norm high enough that no step clips: the clip's own 1e-6 term is not divided.
    plain, plain_logs = _train_tiny_clm(module, tiny_model, text, tmp_path / "a", "--max_grad_norm", "1e6")
    small, small_logs = _train_tiny_clm(
        module, tiny_model, text, tmp_path / "b", "--max_grad_norm", "1e6", "--loss_divisor", "256"
    )
    assert plain.keys() == small.keys()
    assert all(torch.equal(plain[k], small[k]) for k in plain)
    losses = [[e["loss"] for e in logs if "loss" in e] for logs in (plain_logs, small_logs)]
    assert losses[0] == losses[1] and len(losses[0]) == 4
    norms = [[e["grad_norm"] for e in logs if "grad_norm" in e] for logs in (plain_logs, small_logs)]
    assert norms[1] == pytest.approx([n / 256 for n in norms[0]], rel=1e-5)


def test_loss_divisor_reaches_the_flushed_probe_and_fp16(tmp_path, tiny_model):
    """In emulated FP16 without scaling the divided gradients flush more: the probe (which computes
    the loss through the Trainer's compute_loss) reports a larger flushed fraction at divisor 2^12
    than at 1. Bug caught: the probe measuring the undivided loss, i.e. predicting the wrong run."""
    module = load_recipe("language_modeling")
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"line {i} of a short text about loss scaling in FP16" for i in range(300)))
    fractions = []
    for name, divisor in (("one", "1"), ("many", "4096")):
        _, logs = _train_tiny_clm(
            module, tiny_model, text, tmp_path / name, "--fp16", "--loss_scale_init", "1",
            "--loss_scale_growth_interval", "1000", "--loss_scale_measure_flushed", "--loss_divisor", divisor,
        )  # fmt: skip
        probe = next(e for e in events(tmp_path / name) if e["event"] == "flushed_probe")
        fractions.append(probe["flushed_fraction"])
    assert fractions[1] > fractions[0] + 0.05, fractions


@pytest.mark.parametrize("divisor", ["0", "3", "-2"])
def test_loss_divisor_must_be_a_power_of_two(divisor):
    module = load_recipe("language_modeling")
    with pytest.raises(ValueError, match="power of two"):
        module.DataTrainingArguments(train_file="x.txt", loss_divisor=int(divisor))


def test_the_final_evaluation_reused_from_the_log_keeps_a_nan_a_number():
    """Found by pure FP16 on tiny-shakespeare (its eval loss went NaN): the recipes reuse the last
    logged evaluation, where the log holds NaN as null, and `math.exp(None)` (perplexity) then raised
    after training had finished."""
    import math
    from types import SimpleNamespace

    from hf_lossscale.recipes.recipe_args import _eval_at_last_step

    state = SimpleNamespace(global_step=5, log_history=[{"eval_loss": None, "eval_runtime": 1.0, "step": 5}])
    found = _eval_at_last_step(SimpleNamespace(state=state), SimpleNamespace(do_train=True))
    assert math.isnan(found["eval_loss"]) and found["eval_runtime"] == 1.0
