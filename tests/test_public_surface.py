"""Every public name of the last release still works (issue 56): the names `hf_lossscale` exports, the
public members of its classes, the `hf-lossscale` commands, recorded at commit 6ec0b09 (the last one with
`LossScaleConfig.to_deepspeed_config()`) in `tests/data/public_surface_6ec0b09.json`. A name that goes
away must go through a deprecation first: `to_deepspeed_config` is the one that did.

Bug caught: a method or field removed or renamed in a refactor (as `to_deepspeed_config` was, without a
deprecation), an export dropped from `_LAZY`, a subcommand lost from the CLI.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import hf_lossscale

SURFACE = json.loads((Path(__file__).parent / "data" / "public_surface_6ec0b09.json").read_text())


@pytest.mark.parametrize("name", SURFACE["exports"])
def test_each_export_of_the_last_release_resolves(name):
    assert name in hf_lossscale.__all__
    assert getattr(hf_lossscale, name) is not None


def _ours(cls_name: str, members: list[str]) -> list[str]:
    """The members to hold to: for the training arguments, ours (`loss_scale_*` and our methods), not the
    fields transformers itself adds or drops between releases."""
    if cls_name != "LossScaleTrainingArguments":
        return members
    from transformers import TrainingArguments

    theirs = {f.name for f in dataclasses.fields(TrainingArguments)} | set(dir(TrainingArguments))
    return [m for m in members if m.startswith("loss_scale") or m not in theirs]


@pytest.mark.parametrize("cls_name", sorted(SURFACE["members"]))
def test_each_public_member_of_the_last_release_is_there(cls_name):
    cls = getattr(hf_lossscale, cls_name)
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    missing = [
        m for m in _ours(cls_name, SURFACE["members"][cls_name]) if m not in fields and not hasattr(cls, m)
    ]
    assert missing == [], f"{cls_name} lost {missing}: deprecate before removing"


def test_the_removed_to_deepspeed_config_method_warns_and_gives_the_functions_answer():
    """Bug caught: the deprecated method gone again, silent (no FutureWarning), naming no replacement, or
    drifting from the function it stands for."""
    from hf_lossscale import LossScaleConfig
    from hf_lossscale.integrations.deepspeed import to_deepspeed_config

    for config in (LossScaleConfig(init_scale=2.0**12, hysteresis=2), LossScaleConfig(mode="static"),
                   LossScaleConfig(mode="off")):  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old = config.to_deepspeed_config()
        future = [w for w in caught if issubclass(w.category, FutureWarning)]
        assert len(future) == 1 and "integrations.deepspeed.to_deepspeed_config" in str(future[0].message)
        assert future[0].filename == __file__  # it points at the caller's line
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert old == to_deepspeed_config(config)


@pytest.mark.parametrize("command", SURFACE["commands"])
def test_each_command_of_the_last_release_answers(command):
    out = subprocess.run([sys.executable, "-m", "hf_lossscale.tools.cli", command, "--help"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage" in out.stdout
