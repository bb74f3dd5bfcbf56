"""The light core: what needs an extra says which one. (That the core imports and trains without the
extras is checked where they are truly absent: a fresh venv with `pip install .`, see the README.)"""

import sys

import pytest

from hf_lossscale._extras import need


def test_a_tool_without_its_extra_names_the_extra(monkeypatch, tmp_path):
    """Bug caught: a bare ModuleNotFoundError where the user needs `pip install 'hf_lossscale[tools]'`."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'hf_lossscale\[tools\]'"):
        need("matplotlib", "a plot", "tools")
    from hf_lossscale.tools.report import make_report

    (tmp_path / "loss_scale_log.jsonl").write_text('{"event": "run_start", "time": 0}\n')
    with pytest.raises(
        ImportError, match=r"hf-lossscale report's plots needs `matplotlib`.*hf_lossscale\[tools\]"
    ):
        make_report(tmp_path, tmp_path / "out")
