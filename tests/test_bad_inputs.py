"""Bad input on every surface: each case must fail with an error that names the offending field,
key, flag or variable and the allowed values. `pytest tests/test_bad_inputs.py -q` counts the
cases (one test each); the surfaces: `LossScaleConfig` fields, `LossScaleTrainingArguments`
flags, YAML/JSON config files, `HF_LOSSSCALE_*` variables, scaler state dicts."""

import math

import pytest

from hf_lossscale import DynamicLossScaler, LossScaleConfig, LossScaleTrainingArguments
from hf_lossscale.core.config import resolve_config

# (field, bad value, what the message must say about the allowed values)
FIELDS = [
    ("mode", "dynamc", "one of"), ("mode", 3, "one of"), ("mode", None, "one of"),
    ("init_scale", 0.0, "> 0"), ("init_scale", -1.0, "> 0"), ("init_scale", math.inf, "finite"),
    ("init_scale", math.nan, "finite"), ("init_scale", "big", "number"), ("init_scale", True, "number"),
    ("min_scale", 0.0, "> 0"), ("min_scale", -2.0, "> 0"), ("max_scale", math.inf, "finite"),
    ("max_scale", "2**24", "number"),
    ("growth_factor", 1.0, "> 1"), ("growth_factor", 0.5, "> 1"), ("growth_factor", math.inf, "> 1"),
    ("growth_factor", math.nan, "> 1"),
    ("backoff_factor", 0.0, "(0, 1)"), ("backoff_factor", 1.0, "(0, 1)"), ("backoff_factor", 1.5, "(0, 1)"),
    ("backoff_factor", -0.5, "(0, 1)"),
    ("growth_interval", 0, "[1, 2**31 - 1]"), ("growth_interval", -3, "[1, 2**31 - 1]"),
    ("growth_interval", 2.5, "integer"),
    # the int32 tracker would wrap and grow the scale on every step (issue 30)
    ("growth_interval", 2**31, "[1, 2**31 - 1]"), ("hysteresis", 2**31, "[1, 2**31 - 1]"),
    # a reciprocal that overflows (clean gradients unscaled to inf, then stepped) or an inf scale
    ("init_scale", 2.0**-130, "FP32's normal range"), ("min_scale", 2.0**-149, "FP32's normal range"),
    ("max_scale", 1e39, "FP32's normal range"), ("max_consecutive_skips", 2**63, "[1, 2**63 - 1]"),
    ("growth_interval", True, "integer"), ("growth_interval", "10", "integer"),
    ("hysteresis", 0, "[1, 2**31 - 1]"), ("hysteresis", "2", "integer"), ("hysteresis", 1.0, "integer"),
    ("consecutive_hysteresis", "yes", "True or False"), ("consecutive_hysteresis", 1, "True or False"),
    ("max_consecutive_skips", 0, "[1, 2**63 - 1]"), ("max_consecutive_skips", 1.5, "integer"),
    ("max_consecutive_skips", -1, "[1, 2**63 - 1]"),
    ("fp16_on_cpu", "fast", "one of"), ("fp16_on_cpu", None, "one of"),
]  # fmt: skip


@pytest.mark.parametrize(("field", "value", "allowed"), FIELDS)
def test_config_field(field, value, allowed):
    with pytest.raises((ValueError, TypeError)) as err:
        LossScaleConfig(**{field: value})
    assert f"LossScaleConfig.{field}=" in str(err.value) and allowed in str(err.value)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"min_scale": 8.0, "max_scale": 4.0}, "min_scale"),
        ({"init_scale": 2.0, "min_scale": 4.0}, "init_scale"),
        ({"init_scale": 2.0**30}, "init_scale"),
        ({"moed": "static"}, "moed"),
    ],
)
def test_config_field_combinations(fields, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LossScaleConfig(**fields)


# (flag, bad command-line value)
FLAGS = [
    ("--loss_scale_mode", "dynamc"), ("--loss_scale_init", "big"), ("--loss_scale_init", "-4"),
    ("--loss_scale_init", "inf"), ("--loss_scale_growth_factor", "1"), ("--loss_scale_backoff_factor", "2"),
    ("--loss_scale_growth_interval", "2.5"), ("--loss_scale_growth_interval", "0"), ("--loss_scale_min", "0"),
    ("--loss_scale_max", "nan"), ("--loss_scale_hysteresis", "0"), ("--loss_scale_hysteresis", "x"),
    ("--loss_scale_consecutive_hysteresis", "maybe"), ("--loss_scale_max_consecutive_skips", "-2"),
    ("--loss_scale_fp16_on_cpu", "fast"),
]  # fmt: skip


@pytest.mark.parametrize(("flag", "value"), FLAGS)
def test_training_arguments_flag(tmp_path, capsys, flag, value):
    from transformers import HfArgumentParser

    parser = HfArgumentParser(LossScaleTrainingArguments)
    argv = ["--output_dir", str(tmp_path), "--fp16", "--report_to", "none", flag, value]
    try:
        parser.parse_args_into_dataclasses(args=argv)
    except SystemExit:  # argparse refused the type: its message names the flag
        assert f"argument {flag}" in capsys.readouterr().err
    except ValueError as err:  # our validation: the message names the flag
        assert f"set by {flag})" in str(err), str(err)
    else:
        pytest.fail(f"{flag} {value} was accepted")


FILES = [
    ("mode: [dynamic]\n", ".yaml", "LossScaleConfig.mode="),
    ("init_scale: big\n", ".yaml", "LossScaleConfig.init_scale="),
    ("growth_interval: 2.5\n", ".yaml", "LossScaleConfig.growth_interval="),
    ("hysteresis: true\n", ".yaml", "LossScaleConfig.hysteresis="),
    ("modee: static\n", ".yaml", "modee"),
    ("- mode\n- static\n", ".yaml", "mapping"),
    ("42\n", ".yaml", "mapping"),
    ("mode: [\n", ".yaml", "Cannot parse"),
    ('{"mode": "static",}', ".json", "Cannot parse"),
    ('{"init_scale": -1}', ".json", "LossScaleConfig.init_scale="),
    ('{"unknown": 1}', ".json", "unknown"),
    ('["mode"]', ".json", "mapping"),
]


@pytest.mark.parametrize(("text", "suffix", "match"), FILES)
def test_config_file(tmp_path, text, suffix, match):
    path = tmp_path / f"ls{suffix}"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        LossScaleConfig.from_file(path)
    assert match in str(err.value) and str(path) in str(err.value)
    # the same file through HF_LOSSSCALE_CONFIG
    with pytest.raises(ValueError) as err:
        resolve_config(None, None, {"HF_LOSSSCALE_CONFIG": str(path)})
    assert match in str(err.value)


def test_config_file_unreadable(tmp_path):
    for path in (tmp_path / "missing.yaml", tmp_path):  # absent; a folder
        with pytest.raises(ValueError, match=f"Cannot read .*{path.name}"):
            LossScaleConfig.from_file(path)
        with pytest.raises(ValueError, match=path.name):
            resolve_config(None, None, {"HF_LOSSSCALE_CONFIG": str(path)})


ENV = [
    ("HF_LOSSSCALE_INIT_SCALE", "big"), ("HF_LOSSSCALE_INIT_SCALE", "-1"), ("HF_LOSSSCALE_INIT_SCALE", "inf"),
    ("HF_LOSSSCALE_GROWTH_INTERVAL", "2.5"), ("HF_LOSSSCALE_GROWTH_INTERVAL", "0"),
    ("HF_LOSSSCALE_HYSTERESIS", "many"), ("HF_LOSSSCALE_CONSECUTIVE_HYSTERESIS", "perhaps"),
    ("HF_LOSSSCALE_MODE", "sometimes"), ("HF_LOSSSCALE_BACKOFF_FACTOR", "1.5"),
    ("HF_LOSSSCALE_MAX_CONSECUTIVE_SKIPS", "-1"), ("HF_LOSSSCALE_FP16_ON_CPU", "gpu"),
    ("HF_LOSSSCALE_INIT", "1024"), ("HF_LOSSSCALE_MINSCALE", "1"),
]  # fmt: skip


@pytest.mark.parametrize(("var", "value"), ENV)
def test_environment_variable(var, value):
    with pytest.raises(ValueError) as err:
        resolve_config(None, None, {var: value})
    assert var in str(err.value)  # the variable itself is named, with the field's allowed values
    if var in ("HF_LOSSSCALE_INIT", "HF_LOSSSCALE_MINSCALE"):  # unknown names list the known ones
        assert "HF_LOSSSCALE_INIT_SCALE" in str(err.value)


def test_data_variables_are_not_scaler_settings():
    """The tests' data folder variables live in our namespace but configure nothing: a training
    run started under CI's environment must not refuse them as unknown settings."""
    env = {"HF_LOSSSCALE_DATA": "/data", "HF_LOSSSCALE_REQUIRE_DATA": "1"}
    assert resolve_config(None, None, env) == resolve_config(None, None, {})


GOOD_STATE = DynamicLossScaler().state_dict()
STATES = [
    ([1], "must be a dict"),
    ({}, "empty"),
    ({"scale": 2.0}, "missing key"),
    ({**GOOD_STATE, "scale": -1.0}, "scale=-1.0"),
    ({**GOOD_STATE, "scale": math.nan}, "scale=nan"),
    ({**GOOD_STATE, "scale": "big"}, "scale='big'"),
    ({**GOOD_STATE, "total_steps": "3"}, "total_steps='3'"),
    ({**GOOD_STATE, "skipped_steps": -1}, "skipped_steps=-1"),
    ({**GOOD_STATE, "_growth_tracker": 1.5}, "_growth_tracker=1.5"),
    ({**GOOD_STATE, "config": "dynamic"}, "config"),
    ({**GOOD_STATE, "config": {**GOOD_STATE["config"], "growth_factor": 0.5}}, "growth_factor=0.5"),
    ({**GOOD_STATE, "config": {**GOOD_STATE["config"], "colour": 1}}, "colour"),
]


@pytest.mark.parametrize(("state", "match"), STATES)
def test_state_dict(state, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        DynamicLossScaler().load_state_dict(state)
