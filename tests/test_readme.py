"""The README and the docs pages, read top to bottom, work as written: every ```bash and ```python
block runs. Pages are read in the site's order (README.md, then mkdocs.yml's nav), and the Python
blocks of all of them run in one namespace, so a page may use what an earlier one built.

A block right after a `<!-- readme-test: skip (why) -->` line is not run (it needs a GPU or the
network); every other block is. A block that reads the benchmark data (`../shared/data` in it, or
`<!-- readme-test: needs data -->` above it) is skipped when the data is absent, as `@needs_data`
tests are (and fails in CI, which requires the data). Python blocks run in order in one namespace that holds what the
README calls "yours": `model` (a tiny BERT classifier), `batch`, `loader`, `optimizer`,
`train_dataset`, `prompts`. Shell commands run with bash from the repository root, in their
short form where running them in full takes minutes (`SHORT_FORMS`, each applied by a regex), with
`runs/` sent to a temporary folder and `../shared/data` read from `HF_LOSSSCALE_DATA`.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_data import DATA, REQUIRED

ROOT = Path(__file__).resolve().parents[1]
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s*\((.+)\)\s*-->")
NEEDS_DATA = "<!-- readme-test: needs data -->"  # reads ../shared/data without naming it in the block

#: (pattern, replacement, why): the short form of a command that runs for minutes in full.
SHORT_FORMS = [
    (r"^make (\S+)$", r"make -n \1", "make targets install and run whole suites: a dry run shows the target and its commands"),
    (r"(recipes/grpo\.py\b.*)--max_steps \d+", r"\1--max_steps=2", "GRPO: two optimizer steps (no row limits to pass)"),
    (r"(benchmarks/grpo_compare\.py)\b.*", r"\1 --help", "nine GRPO runs take 40 CPU-minutes"),
    (r"--max_steps \d+", "--max_steps 2 --max_train_samples 32 --max_eval_samples 8 --max_seq_length 32",
     "a recipe: two optimizer steps on a few rows"),
    (r"(benchmarks/reproduce/run\.py) table --write", r"\1 table", "print the tables instead of rewriting the README"),
    (r"(benchmarks/reproduce/run\.py) (?!table)(\S+)", r"\1 \2 --print", "print the benchmark's command"),
    (r"(benchmarks/underflow_map\.py)\b.*", r"\1 --help", "the full map takes 30 CPU-minutes"),
    (r'--points "[^"]*"', '--points "1x32x1"', "one small point"),
    (r"(benchmarks/gpu_prepare\.py)$", r"\1 --help", "it downloads wheels into .whl/"),
    (r"^bash (benchmarks/gpu_dryrun\.sh)$", r"bash -n \1", "it builds a venv (minutes): parse it"),
    (r"(hf-lossscale precision .*)$", r"\1 --model llama --eval_blocks 1 --train_blocks 1 --finetune_steps 1 --block_size 16",
     "one block, one fine-tune step, the small decoder"),
    (r"(hf-lossscale advise .*)$", r"\1 --steps 1 --block_size 32 --per_device_train_batch_size 1",
     "one short FP32 step"),
]  # fmt: skip


def pages():
    """README.md, then the docs pages in mkdocs.yml's nav order (every page under docs/ in it)."""
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [ROOT / "README.md", *(ROOT / "docs" / next(iter(entry.values())) for entry in nav)]


def blocks(page):
    """(where, language, code, skip reason or None) of each fenced bash/python block of `page`."""
    lines = page.read_text().splitlines()
    name = page.relative_to(ROOT).as_posix()
    out, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(bash|python)\s*$", lines[i])
        if fence:
            end = lines.index("```", i + 1)
            before = lines[i - 1] if i else ""
            skip = SKIP.search(before)
            code = "\n".join(lines[i + 1 : end])
            if before.strip() == NEEDS_DATA:
                code = "# reads ../shared/data\n" + code
            out.append((f"{name}:{i + 1}", fence.group(1), code, skip and skip.group(1)))
            i = end
        i += 1
    return out


def commands(code):
    """Shell commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\s*\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        quoted, kept = None, []
        for k, ch in enumerate(line):
            if quoted:
                quoted = None if ch == quoted else quoted
            elif ch in "'\"":
                quoted = ch
            elif ch == "#" and (k == 0 or line[k - 1].isspace()):
                break
            kept.append(ch)
        if "".join(kept).strip():
            out.append("".join(kept).strip())
    return out


def short_form(command, runs):
    for pattern, replacement, _ in SHORT_FORMS:
        command = re.sub(pattern, replacement, command)
    command = re.sub(r"(^|\s)runs/", rf"\g<1>{runs}/", command)
    return command.replace("../shared/data", str(DATA))


PAGES = pages()
BLOCKS = [b for page in PAGES for b in blocks(page)]


def test_every_docs_page_is_in_the_nav():
    """Bug caught: a page added to docs/ but not to mkdocs.yml's nav, whose blocks nobody runs."""
    assert sorted(p.name for p in (ROOT / "docs").glob("*.md")) == sorted(p.name for p in PAGES[1:])


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_blocks_and_every_skip_says_why(page):
    """Bug caught: a marker that matches nothing (a typo skips silently nothing, or everything)."""
    found = blocks(page)
    lines = [line.strip() for line in page.read_text().splitlines()]
    skips = [line for line in lines if line.startswith("<!-- readme-test: skip")]
    assert len(skips) == sum(skip is not None for *_, skip in found)
    assert lines.count(NEEDS_DATA) == sum(
        code.startswith("# reads ../shared/data") for _, _, code, _ in found
    )
    assert all(line in (NEEDS_DATA, *skips) for line in lines if line.startswith("<!-- readme-test"))


def test_the_pages_have_blocks():
    assert sum(lang == "python" for _, lang, _, _ in BLOCKS) >= 4
    assert sum(lang == "bash" for _, lang, _, _ in BLOCKS) >= 6
    assert sum(skip is not None for *_, skip in BLOCKS) >= 3


def test_short_forms():
    runs = "/tmp/r"
    assert short_form("make demo", runs) == "make -n demo"
    assert short_form("python benchmarks/reproduce/run.py sst2", runs).endswith("run.py sst2 --print")
    assert short_form("python benchmarks/reproduce/run.py table --write", runs).endswith("run.py table")
    assert "--output_dir /tmp/r/x " in short_form("x --output_dir runs/x --max_steps 200", runs) + " "
    assert commands("a \\\n  --b 'c # d' # e\n\n# f\ng") == ["a --b 'c # d'", "g"]


@pytest.fixture(scope="module")
def yours():
    """What the README's Python blocks call the user's own objects."""
    import torch
    from datasets import Dataset
    from tiny_models import tiny_bert_classifier, tiny_classification_dataset

    model = tiny_bert_classifier()
    rows = tiny_classification_dataset(n=16)
    batch = {"input_ids": torch.tensor(rows["input_ids"][:8]), "labels": torch.tensor(rows["labels"][:8])}
    loader = torch.utils.data.DataLoader(rows.with_format("torch"), batch_size=8)
    return {
        "model": model,
        "batch": batch,
        "loader": loader,
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
        "train_dataset": rows,
        "prompts": Dataset.from_dict({"prompt": ["the cat"] * 4}),
    }


def test_python_blocks_run_in_order(yours, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = dict(yours)
    ran = 0
    for where, lang, code, skip in BLOCKS:
        if lang != "python" or skip:
            continue
        try:
            exec(compile(code, where, "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"{where}: the Python block fails: {err!r}") from err
        ran += 1
    assert ran >= 4 and namespace["scaler"].stats()["total_steps"] > 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One `runs/` for every block: a report reads the run an earlier block wrote (README order)."""
    return tmp_path_factory.mktemp("runs")


def _needs_data(code):
    return "../shared/data" in code and not DATA.is_dir() and not REQUIRED


@pytest.mark.parametrize("where,code", [(b[0], b[2]) for b in BLOCKS if b[1] == "bash" and not b[3]],
                         ids=lambda v: v if ".md:" in v else None)  # fmt: skip
def test_shell_block_runs(where, code, runs):
    if _needs_data(code):
        pytest.skip(f"reads the benchmark data, not found at {DATA} (HF_LOSSSCALE_DATA)")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command in commands(code):
        short = short_form(command, runs)
        result = subprocess.run(["bash", "-c", short], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=900)  # fmt: skip
        assert result.returncode == 0, (
            f"{where}: `{command}` (run as `{short}`) failed:\n{(result.stdout + result.stderr)[-3000:]}"
        )


def test_docs_site_builds_strict(tmp_path):
    """`make docs`: mkdocs builds the site with --strict (mkdocs.yml), so a broken link, a page
    outside the nav or an API name that no longer exists fails here. Bug caught: a page moved or a
    public name renamed without the docs following."""
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "growth_interval" in api and "install_loss_scaler" in api  # the docstrings were rendered


def test_docs_build_fails_on_a_broken_link(tmp_path):
    """The check above can fail: the same build with one link to a missing page is refused."""
    import shutil

    shutil.copytree(ROOT / "docs", tmp_path / "docs", symlinks=True)
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    (tmp_path / "hf_lossscale").symlink_to(ROOT / "hf_lossscale")
    page = tmp_path / "docs" / "accelerate.md"
    page.write_text(page.read_text() + "\nSee [the missing page](missing.md).\n")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # fmt: skip
    assert result.returncode != 0 and "missing.md" in result.stderr


def test_the_readme_is_a_landing_page():
    """At most 150 lines (issue 56): the reference lives in docs/. Bug caught: a section of reference
    material growing on the landing page instead of linking to its docs page."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
