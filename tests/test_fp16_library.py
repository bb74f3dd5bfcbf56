"""The FP16 measurements as a library, apart from their command line (issue 46 item 5): `fp16/`
takes keyword arguments and returns results; parsing options, printing, exiting and writing the
command's files are `tools/`'s (`hf-lossscale advise / underflow / preflight / precision`)."""

import ast
from pathlib import Path

import pytest
from tiny_models import minilm_path, save_tiny_bert, tiny_bert_config

FP16 = Path(__file__).resolve().parents[1] / "hf_lossscale" / "fp16"


def test_no_fp16_module_parses_options_prints_or_exits():
    """Bugs caught: an `argparse.Namespace` parameter back in a measurement, a `print` in the library
    (a caller gets text on stdout it did not ask for), `SystemExit` raised where a caller can only
    catch it by catching the interpreter's exit."""
    offenders = []
    for path in sorted(FP16.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if "argparse" in names:
                    offenders.append(f"{path.name}: imports argparse")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in ("print", "SystemExit", "exit"):
                    offenders.append(f"{path.name}:{node.lineno}: {node.func.id}(...)")
    assert offenders == []


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp16lib")
    text = folder / "text.txt"
    text.write_text(
        "\n".join(
            f"line {i} of a small local corpus about loss scaling in half precision" for i in range(300)
        )
    )
    return save_tiny_bert(folder / "model"), str(text), folder


def test_advise_and_preflight_take_keywords_and_return_figures(files, capsys):
    """`advise` and `preflight_checkpoint` on a tiny BERT: figures back, nothing printed; bad input
    is a `ValueError` (the command turns it into its message and exit status)."""
    from hf_lossscale.fp16.advise import advise, load_blocks
    from hf_lossscale.fp16.preflight import classifier_architecture, preflight_checkpoint

    model, text, _ = files
    advice = advise(model, objective="clm", train_file=text, block_size=32, steps=1)
    assert advice["steps"] == 1 and advice["tokens_per_step"] == 4 * 32 and advice["recommended_scale"] >= 1
    flight = preflight_checkpoint(model, objective="clm", train_file=text, block_size=16, steps=1)
    assert flight["model"] == model and flight["modules"] and flight["suggested_init_scale"] >= 1
    assert classifier_architecture(model) is None
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="exactly one of --train_file or --dataset_name"):
        load_blocks(None, train_file=text, dataset_name="glue")


def test_a_classifier_checkpoint_is_named_by_the_library_and_said_by_the_command(files, capsys):
    from transformers import AutoTokenizer, BertForSequenceClassification

    from hf_lossscale.fp16.preflight import classifier_architecture
    from hf_lossscale.tools.cli import main

    _, text, folder = files
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    BertForSequenceClassification(
        tiny_bert_config(vocab_size=tokenizer.vocab_size, num_labels=3)
    ).save_pretrained(folder / "clf")
    tokenizer.save_pretrained(folder / "clf")
    assert classifier_architecture(str(folder / "clf")) == "BertForSequenceClassification"
    assert capsys.readouterr().out == ""
    main(["preflight", "--model_name_or_path", str(folder / "clf"), "--train_file", text, "--block_size", "16",
          "--steps", "1"])  # fmt: skip
    printed = capsys.readouterr().out
    assert "is a sequence classifier (BertForSequenceClassification): measured as one" in printed
    assert "Pre-flight of" in printed and "(cls, 1 batches of 4x16 tokens" in printed


def test_precision_gap_reports_each_model_through_its_callback(files, capsys):
    from hf_lossscale.fp16.precision import precision_gap

    model, text, _ = files
    seen = []
    result = precision_gap(text, models=[model], block_size=16, eval_blocks=2, train_blocks=2, finetune_steps=1,
                           on_model=seen.append)  # fmt: skip
    assert capsys.readouterr().out == ""
    assert result["fp16"] == "emulated on the CPU" and seen == result["models"]
    (entry,) = result["models"]
    assert [s["stage"].split(" (")[0] for s in entry["stages"]] == ["initialisation", "after 1 FP32 steps"]
    assert set(entry["stages"][0]["gap"]) == {"fp16", "bf16"}
    with pytest.raises(ValueError, match="blocks of 16"):
        precision_gap(text, models=[model], block_size=16, eval_blocks=10_000, finetune_steps=0)
