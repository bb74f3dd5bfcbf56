"""The resume rule's one line (`integrations/resume.py`), shared by the Trainer and `accelerator.load_state`."""

import pytest

from hf_lossscale import DynamicLossScaler, LossScaleConfig
from hf_lossscale.core.config import FP16_FIELDS
from hf_lossscale.integrations.resume import config_differences, resume_line

#: What a checkpoint written before the FP16 fields left the scaler's state carried for them.
OLD_FP16 = {"fp16_on_cpu": "native", "fp32_modules": ["classifier"], "max_auto_fp32_modules": 3,
            "master_weights": True}  # fmt: skip


def _old_state(**config):
    state = DynamicLossScaler(LossScaleConfig(**config)).state_dict()
    state["config"] = {**state["config"], **OLD_FP16}
    return state


def test_an_old_checkpoints_fp16_fields_are_not_listed():
    """A checkpoint whose scaler state still carries `fp16_on_cpu`, `fp32_modules`,
    `max_auto_fp32_modules` and `master_weights` (the model's FP16 handling, no longer the scaler's)
    resumes into a run that sets them otherwise: the line names only the scaler's own settings that
    differ. Bug caught: every resume from such a checkpoint listing the four as "differing"."""
    assert set(OLD_FP16) == set(FP16_FIELDS)
    now = LossScaleConfig(growth_interval=7)
    assert all(getattr(now, k) != (tuple(v) if isinstance(v, list) else v) for k, v in OLD_FP16.items())

    state = _old_state(growth_interval=3)
    assert config_differences(state, now) == "growth_interval 7 (checkpoint 3)"
    line = resume_line(state, now, "ckpt")
    assert "growth_interval 7 (checkpoint 3)" in line
    for name in FP16_FIELDS:
        assert name not in line

    assert resume_line(_old_state(growth_interval=7), now, "ckpt") is None  # nothing of the scaler's differs


@pytest.mark.parametrize("field", ["hysteresis", "min_scale"])
def test_the_scalers_own_settings_are_still_listed(field):
    state = _old_state()
    now = LossScaleConfig(**{field: {"hysteresis": 2, "min_scale": 4.0}[field]})
    assert config_differences(state, now).startswith(f"{field} ")
