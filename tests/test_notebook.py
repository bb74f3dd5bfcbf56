"""The teaching notebook: committed without outputs, identical to what its builder writes, and it
runs top to bottom on the CPU (FP16 emulated) with the figures it explains."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # an extra (`dev`); absent on the GPU machine

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "loss_scaling_explained.ipynb"


def test_committed_notebook_is_built_and_stripped():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_notebook", NOTEBOOK.with_name("build_notebook.py"))
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    committed = nbformat.read(NOTEBOOK, as_version=4)
    assert [c.source for c in committed.cells] == [c.source for c in builder.build().cells]
    assert all(not c.get("outputs") for c in committed.cells if c.cell_type == "code")


def test_notebook_runs(monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend shows the figures
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # a cell takes ~10-40 s on an idle 2-core CPU; 180 s timed out once under three training streams
    NotebookClient(nb, timeout=600, kernel_name="python3").execute()
    text = "\n".join(
        o.get("text", "")
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "stream"
    )
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert "largest 65504.0" in text and "smallest subnormal 2^-24" in text
    assert "static 2^24: loss" in text and "skipped 30/30; overflow" in text
    no_scaling = next(line for line in text.splitlines() if "/256, no scaling" in line)
    assert float(no_scaling.split("; ")[-1].split("%")[0]) > 50  # most gradient elements flushed
    assert (
        sum(o.output_type == "display_data" for c in nb.cells if c.cell_type == "code" for o in c.outputs)
        >= 3
    )


if __name__ == "__main__":
    pytest.main([__file__])
