"""GLUE as `run_glue.py` takes it (`--task_name`), from files in GLUE's own layouts (gluebenchmark.com's
download: CoLA without a header, MRPC's `#1 String`/`Quality`, STS-B's `score`, MNLI's `gold_label`
and matched/mismatched dev files), a few hand-written rows each."""

import pytest
from test_recipes import load_recipe
from tiny_models import save_tiny_bert

GOOD, BAD = "a fine and good film", "an awful and bad film"


def _tsv(path, header, rows):
    lines = (["\t".join(header)] if header else []) + ["\t".join(map(str, r)) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def glue_files(task, folder):
    """train and dev files (MNLI: dev_matched and dev_mismatched) as GLUE distributes them."""
    pairs = [(GOOD, "it was good", 1), (BAD, "it was bad", 0)] * 4
    files = {}
    for split in ("train", "dev") if task != "mnli" else ("train", "dev_matched", "dev_mismatched"):
        path = folder / f"{split}.tsv"
        if task == "cola":  # no header: source, label, the original annotation, sentence
            rows = [("gj04", y, "" if y else "*", a) for a, _, y in pairs]
            files[split] = _tsv(path, None, rows)
        elif task == "sst2":
            files[split] = _tsv(path, ["sentence", "label"], [(a, y) for a, _, y in pairs])
        elif task == "mrpc":
            rows = [(y, 100 + i, 200 + i, a, b) for i, (a, b, y) in enumerate(pairs)]
            files[split] = _tsv(path, ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"], rows)
        elif task == "qqp":
            rows = [(i, 2 * i, 2 * i + 1, a + "?", b + "?", y) for i, (a, b, y) in enumerate(pairs)]
            files[split] = _tsv(path, ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"], rows)
        elif task == "stsb":
            header = ["index", "genre", "filename", "year", "old_index", "source1", "source2",
                      "sentence1", "sentence2", "score"]  # fmt: skip
            rows = [(i, "main-captions", "MSRvid", "2012test", i, "none", "none", a, b, f"{4.2 * y + 0.4:.3f}")
                    for i, (a, b, y) in enumerate(pairs)]  # fmt: skip
            files[split] = _tsv(path, header, rows)
        elif task == "mnli":
            names = ["entailment", "neutral", "contradiction"]
            labels = ["label1"] if split == "train" else [f"label{k}" for k in range(1, 6)]
            header = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
                      "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", *labels, "gold_label"]  # fmt: skip
            rows = [(i, i, f"{i}e", "fiction", "( a )", "( b )", "(ROOT a)", "(ROOT b)", a, b,
                     *[names[2 - 2 * y]] * len(labels), names[2 - 2 * y]) for i, (a, b, y) in enumerate(pairs)]  # fmt: skip
            files[split] = _tsv(path, header, rows)
        else:  # qnli, rte, wnli: index, two texts, label (strings for QNLI and RTE)
            first, second = ("question", "sentence") if task == "qnli" else ("sentence1", "sentence2")
            names = {"qnli": ["not_entailment", "entailment"], "rte": ["not_entailment", "entailment"]}
            rows = [(i, a, b, names[task][y] if task in names else y) for i, (a, b, y) in enumerate(pairs)]
            files[split] = _tsv(path, ["index", first, second, "label"], rows)
    return files


EXPECTED = {  # task -> (text columns, number of labels, eval metrics)
    "cola": (("sentence", None), 2, {"eval_matthews_correlation"}),
    "sst2": (("sentence", None), 2, {"eval_accuracy"}),
    "mrpc": (("sentence1", "sentence2"), 2, {"eval_accuracy", "eval_f1"}),
    "qqp": (("question1", "question2"), 2, {"eval_accuracy", "eval_f1"}),
    "stsb": (("sentence1", "sentence2"), 1, {"eval_pearsonr", "eval_spearmanr"}),
    "mnli": (("premise", "hypothesis"), 3, {"eval_accuracy", "eval_accuracy_mm", "eval_loss_mm"}),
    "qnli": (("question", "sentence"), 2, {"eval_accuracy"}),
    "rte": (("sentence1", "sentence2"), 2, {"eval_accuracy"}),
    "wnli": (("sentence1", "sentence2"), 2, {"eval_accuracy"}),
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def _data_args(module, task, files, **extra):
    return module.DataTrainingArguments(
        task_name=task,
        train_file=files["train"],
        validation_file=files.get("dev", files.get("dev_matched")),
        validation_mismatched_file=files.get("dev_mismatched"),
        **extra,
    )


@pytest.mark.parametrize("task", list(EXPECTED))
def test_task_picks_columns_labels_and_reads_glue_files(task, tmp_path):
    """Each task's columns and label ids from its GLUE files: catches a GLUE column left unrenamed (MRPC's
    `#1 String`), CoLA's first row taken as a header, MNLI's labels in another order than the Hub's."""
    from hf_lossscale.recipes.recipe_args import ModelArguments, load_raw_datasets

    module = load_recipe("text_classification")
    data = _data_args(module, task, glue_files(task, tmp_path))
    raw = module.rename_glue_columns(data, load_raw_datasets(data, ModelArguments("m"),
                                                              headerless=module.glue_file_columns(data)))  # fmt: skip
    columns, num_labels, _ = EXPECTED[task]
    assert module.text_columns(data, raw["train"]) == columns
    assert len(raw["train"]) == 8  # CoLA: no row lost to a header
    labels = module.label_names(data, raw)
    ids = module.label_ids(labels, "label", raw["validation"]["label"])
    if num_labels == 1:
        assert labels is None and ids == pytest.approx([4.6, 0.4] * 4)
    else:
        assert len(labels) == num_labels
        # Row 0 is the "good" pair: acceptable / equivalent / duplicate / entailment in the Hub's ids.
        hub_id = {"mnli": 0, "qnli": 0, "rte": 0}.get(task, 1)
        assert ids[:2] == [hub_id, {"mnli": 2}.get(task, 1 - hub_id)]
    if task == "mnli":
        assert set(raw) == {"train", "validation", "validation_mismatched"}


@pytest.mark.parametrize("task", list(EXPECTED))
def test_task_trains_and_reports_its_metrics(task, tmp_path, tiny_model):
    """A short FP16 (emulated) run per task from GLUE-format files: regression trains for STS-B (one
    output, Pearson/Spearman), MNLI reports the mismatched split as `*_mm`."""
    module = load_recipe("text_classification")
    files = glue_files(task, tmp_path)
    data = _data_args(module, task, files)
    argv = ["--task_name", task, "--train_file", data.train_file, "--validation_file", data.validation_file,
            *(["--validation_mismatched_file", data.validation_mismatched_file] if task == "mnli" else []),
            "--do_train", "--do_eval", "--model_name_or_path", tiny_model, "--output_dir", str(tmp_path / "out"),
            "--fp16", "--max_steps", "2", "--per_device_train_batch_size", "4", "--report_to", "none",
            "--save_strategy", "no", "--disable_tqdm", "true"]  # fmt: skip
    metrics = module.main(argv)
    _, num_labels, names = EXPECTED[task]
    assert names <= set(metrics), sorted(metrics)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tmp_path / "out")
    assert config.num_labels == num_labels
    if num_labels == 1:
        assert config.problem_type == "regression"


def test_headerless_file_without_a_layout_names_the_file_and_the_flag(tmp_path, tiny_model):
    module = load_recipe("text_classification")
    train = _tsv(tmp_path / "train.tsv", None, [("a fine film", 1), ("a bad film", 0)] * 4)
    argv = ["--train_file", train, "--do_train", "--model_name_or_path", tiny_model,
            "--output_dir", str(tmp_path / "out"), "--max_steps", "1", "--report_to", "none"]  # fmt: skip
    with pytest.raises(ValueError, match=r"train\.tsv: the first row \['a fine film', '1'\].*--column_names"):
        module.main(argv)
    metrics = module.main([*argv, "--column_names", "sentence,label", "--do_eval"])
    assert "eval_accuracy" in metrics


def test_task_name_alone_means_glue_from_the_hub_and_is_checked():
    module = load_recipe("text_classification")
    args = module.DataTrainingArguments(task_name="CoLA")
    assert (args.task_name, args.dataset_name, args.dataset_config_name) == ("cola", "nyu-mll/glue", "cola")
    with pytest.raises(ValueError, match="--task_name 'colaa' is not one of"):
        module.DataTrainingArguments(task_name="colaa")
    with pytest.raises(ValueError, match="MNLI's"):
        module.DataTrainingArguments(train_file="t.tsv", validation_mismatched_file="mm.tsv")
    # The Hub config name alone still picks the task, as before --task_name existed.
    assert (
        module.DataTrainingArguments(dataset_name="nyu-mll/glue", dataset_config_name="stsb").task_name
        == "stsb"
    )


def test_unknown_label_value_is_an_error_naming_it():
    module = load_recipe("text_classification")
    with pytest.raises(ValueError, match=r"Label 'maybe' in column 'label' is not one of"):
        module.label_ids(["entailment", "not_entailment"], "label", ["entailment", "maybe"])
    assert module.label_ids(["a", "b"], "label", [1, "0", "b", -1, ""]) == [1, 0, 1, -1, -1]


def test_glob_train_file_and_missing_file(tmp_path):
    """A glob reads every match (datasets' own pattern support stays); a missing file is named."""
    from hf_lossscale.recipes.recipe_args import ModelArguments, load_raw_datasets

    module = load_recipe("text_classification")
    for part in ("a", "b"):
        _tsv(tmp_path / f"train-{part}.tsv", ["sentence", "label"], [(GOOD, 1), (BAD, 0)])
    data = module.DataTrainingArguments(
        train_file=str(tmp_path / "train-*.tsv"), validation_split_percentage=50
    )
    raw = load_raw_datasets(data, ModelArguments("m"))
    assert len(raw["train"]) + len(raw["validation"]) == 4
    data.train_file = str(tmp_path / "nope.tsv")
    with pytest.raises(FileNotFoundError, match="--train_file .*nope.tsv"):
        load_raw_datasets(data, ModelArguments("m"))


def test_a_metric_without_a_local_module_is_not_fetched_from_the_hub(tmp_path, monkeypatch):
    """Issue 30: `evaluate.load(name)` for an unknown metric downloads and runs a script from the Hub.
    Bug caught: remote code run without the user asking; the error names the flag and what ships."""
    module = load_recipe("text_classification")
    files = glue_files("sst2", tmp_path)
    calls = []
    monkeypatch.setattr(module.evaluate, "load", lambda what, *a, **k: calls.append(what) or object())
    data = _data_args(module, "sst2", files, metric_names="accuracy,bleurt")
    with pytest.raises(ValueError, match=r"'bleurt'.*--allow_remote_metrics true.*\['accuracy'"):
        module.build_metrics(data, 2)
    assert calls == [str(module.METRICS_DIR / "accuracy")]  # the local one only; nothing fetched
    calls.clear()
    data = _data_args(module, "sst2", files, metric_names="accuracy,bleurt", allow_remote_metrics=True)
    module.build_metrics(data, 2)
    assert calls == [str(module.METRICS_DIR / "accuracy"), "bleurt"]  # asked for: allowed
