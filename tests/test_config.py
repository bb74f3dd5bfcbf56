import json
import math

import pytest

from hf_lossscale import LossScaleConfig

BAD_FIELDS = [
    ("mode", "dynamc"),
    ("mode", 3),
    ("init_scale", 0.0),
    ("init_scale", -1.0),
    ("init_scale", math.inf),
    ("init_scale", math.nan),
    ("init_scale", "big"),
    ("min_scale", 0.0),
    ("max_scale", math.inf),
    ("growth_factor", 1.0),
    ("growth_factor", 0.5),
    ("growth_factor", math.inf),
    ("backoff_factor", 0.0),
    ("backoff_factor", 1.0),
    ("backoff_factor", 1.5),
    ("growth_interval", 0),
    ("growth_interval", 2.5),
    ("growth_interval", True),
    ("hysteresis", 0),
    ("hysteresis", "2"),
    ("consecutive_hysteresis", "yes"),
    ("max_consecutive_skips", 0),
    ("max_consecutive_skips", 1.5),
]


@pytest.mark.parametrize(("name", "value"), BAD_FIELDS)
def test_each_bad_field_is_named(name, value):
    with pytest.raises(ValueError) as err:
        LossScaleConfig(**{name: value})
    assert f"LossScaleConfig.{name}=" in str(err.value)
    assert repr(value) in str(err.value)


def test_min_above_max_and_init_outside_range():
    with pytest.raises(ValueError, match="min_scale=.*above max_scale"):
        LossScaleConfig(min_scale=8.0, max_scale=4.0, init_scale=4.0)
    with pytest.raises(ValueError, match=r"init_scale=2\.0 is outside \[min_scale, max_scale\]"):
        LossScaleConfig(init_scale=2.0, min_scale=4.0)
    with pytest.raises(ValueError, match="init_scale=.*outside"):
        LossScaleConfig(init_scale=2.0**30)


def test_defaults_match_the_spec():
    c = LossScaleConfig()
    assert (c.mode, c.init_scale, c.growth_factor, c.backoff_factor, c.growth_interval) == (
        "dynamic",
        65536.0,
        2.0,
        0.5,
        2000,
    )
    assert (c.min_scale, c.max_scale, c.hysteresis, c.consecutive_hysteresis, c.max_consecutive_skips) == (
        1.0,
        2.0**24,
        1,
        False,
        100,
    )
    assert LossScaleConfig(max_consecutive_skips=None).max_consecutive_skips is None


def test_dict_round_trip_and_unknown_keys():
    c = LossScaleConfig(mode="static", init_scale=512, hysteresis=3, max_consecutive_skips=None)
    assert LossScaleConfig.from_dict(c.to_dict()) == c
    assert json.loads(json.dumps(c.to_dict())) == c.to_dict()
    with pytest.raises(ValueError, match=r"unknown LossScaleConfig field\(s\) \['init_scal', 'zzz'\]"):
        LossScaleConfig.from_dict({"init_scal": 2.0, "zzz": 1})
    with pytest.raises(ValueError, match="must be a mapping"):
        LossScaleConfig.from_dict([1, 2])


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_file_round_trip(tmp_path, suffix):
    c = LossScaleConfig(init_scale=1024.0, min_scale=2.0, consecutive_hysteresis=True)
    path = tmp_path / f"ls{suffix}"
    c.to_file(path)
    assert LossScaleConfig.from_file(path) == c


def test_file_errors_name_the_file(tmp_path):
    nested = tmp_path / "nested.yaml"
    nested.write_text("loss_scale:\n  init_scale: 256.0\n")
    assert LossScaleConfig.from_file(nested).init_scale == 256.0
    bad_value = tmp_path / "bad.yaml"
    bad_value.write_text("growth_factor: 0.5\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: LossScaleConfig\.growth_factor=0\.5"):
        LossScaleConfig.from_file(bad_value)
    not_mapping = tmp_path / "list.yaml"
    not_mapping.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match=r"list\.yaml: a loss-scale config must be a mapping"):
        LossScaleConfig.from_file(not_mapping)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=r"Cannot parse loss-scale config file .*broken\.json"):
        LossScaleConfig.from_file(broken)
    with pytest.raises(ValueError, match=r"Cannot read loss-scale config file .*missing\.yaml"):
        LossScaleConfig.from_file(tmp_path / "missing.yaml")
    unsafe = tmp_path / "unsafe.yaml"
    unsafe.write_text("!!python/object/apply:os.system ['true']\n")
    with pytest.raises(ValueError, match="Cannot parse"):
        LossScaleConfig.from_file(unsafe)


def test_config_module_is_torch_free():
    """A launcher or CI step can build and check a config as users import it (`hf_lossscale.core.config`,
    `from hf_lossscale import LossScaleConfig`), package `__init__` included, without importing torch.
    Bug caught: a torch import in the config path or an eager import in the package's `__init__`."""
    import subprocess
    import sys

    code = (
        "import sys, hf_lossscale.core.config\n"
        "from hf_lossscale import LossScaleConfig\n"
        "LossScaleConfig(fp32_modules='auto').to_dict(); hf_lossscale.core.config.config_from_env({})\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    code = "import sys, hf_lossscale; hf_lossscale.DynamicLossScaler; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "True"
    )


def test_training_arguments_follow_the_config_field_by_field():
    """Issue 31: the `loss_scale_*` TrainingArguments and `LossScaleConfig` are one set of settings.
    Each config field has exactly one argument (`ARG_TO_FIELD`), unset by default (None), typed as the
    field or None (a string for `fp32_modules`, comma-separated), with the field's help and default.
    Bugs caught: a config field without a flag, a flag whose help states a stale default, a flag typed
    so that HfArgumentParser parses it as something else."""
    import dataclasses
    import typing

    from hf_lossscale import LossScaleConfig, LossScaleTrainingArguments
    from hf_lossscale.integrations.training_args import ARG_TO_FIELD, shown

    config_fields = {f.name: f for f in dataclasses.fields(LossScaleConfig)}
    arg_fields = {f.name: f for f in dataclasses.fields(LossScaleTrainingArguments)}
    assert sorted(ARG_TO_FIELD.values()) == sorted(config_fields)
    hints = typing.get_type_hints(LossScaleTrainingArguments)
    config_hints = typing.get_type_hints(LossScaleConfig)
    for arg, name in ARG_TO_FIELD.items():
        spec, target = arg_fields[arg], config_fields[name]
        assert spec.default is None, arg
        # a string for fp32_modules (comma-separated) and master_weights (auto / true / false: the
        # parser takes no bool-or-str union; the config reads the words)
        expected = str if name in ("fp32_modules", "master_weights") else config_hints[name]
        assert set(typing.get_args(hints[arg])) == set(typing.get_args(expected) or (expected,)) | {
            type(None)
        }, arg
        help_text = spec.metadata["help"]
        assert help_text.startswith(target.metadata["help"]), arg
        assert f"(default {shown(target.default)}" in help_text, arg
        assert getattr(LossScaleConfig(), name) == target.default  # the help's default is the one in force


def test_a_huge_value_is_quoted_capped_in_the_error():
    """Issue 47: a value quoted in a config error is capped (a 2-MB string gave a 2-MB message)."""
    from hf_lossscale import LossScaleConfig

    with pytest.raises(ValueError, match=r"\(2000002 characters\) is not one of") as err:
        LossScaleConfig(mode="x" * 2_000_000)
    assert len(str(err.value)) < 400


# ---------------------------------------------------------------- the model's FP16 handling (FP16Config)
def test_the_fp16_part_is_a_config_of_its_own_with_the_same_fields_defaults_and_checks():
    """`config.fp16` is an `FP16Config` holding exactly `FP16_FIELDS`, with `LossScaleConfig`'s
    defaults and normalisation (master_weights as True/False/'auto'/'kahan'/'stochastic_rounding',
    fp32_modules split at commas); a bad value names `FP16Config.<field>`; the fields stay readable
    and writable on `LossScaleConfig`. Bug caught: the two configs' defaults drifting apart, or a
    master_weights spelling one accepts and the other refuses."""
    import dataclasses

    from hf_lossscale.core.config import FP16_FIELDS, FP16Config

    assert tuple(f.name for f in dataclasses.fields(FP16Config)) == FP16_FIELDS
    assert set(FP16_FIELDS) <= set(LossScaleConfig.field_names())
    assert FP16Config() == LossScaleConfig().fp16
    for given, expected in ((True, True), ("off", False), (" Kahan ", "kahan"), ("stochastic_rounding",
                            "stochastic_rounding"), ("AUTO", "auto")):  # fmt: skip
        assert LossScaleConfig(master_weights=given).master_weights == expected
        assert FP16Config(master_weights=given).master_weights == expected
    view = LossScaleConfig(fp32_modules="auto, lm_head", fp16_on_cpu="native", max_auto_fp32_modules=3).fp16
    assert view == FP16Config(fp16_on_cpu="native", fp32_modules=("auto", "lm_head"), max_auto_fp32_modules=3)
    assert view.auto_fp32 and view.fp32_patterns == ("lm_head",)
    assert view.to_dict() == {k: LossScaleConfig(**view.to_dict()).to_dict()[k] for k in FP16_FIELDS}
    for name, value in (("master_weights", "sometimes"), ("fp16_on_cpu", "fast"), ("max_auto_fp32_modules", 0),
                        ("fp32_modules", "a b")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"FP16Config\.{name}"):
            FP16Config(**{name: value})
        with pytest.raises(ValueError, match=rf"LossScaleConfig\.{name}"):
            LossScaleConfig(**{name: value})
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.master_weights = False  # a view: set the field on the LossScaleConfig
    config = LossScaleConfig()
    config.master_weights = False
    assert config.fp16.master_weights is False


def test_the_scalers_part_leaves_the_fp16_fields_out():
    """`scaler_dict()` is `to_dict()` without the FP16 fields: what a scaler checkpoint carries."""
    from hf_lossscale.core.config import FP16_FIELDS

    config = LossScaleConfig(master_weights="kahan", hysteresis=2)
    assert config.scaler_dict() == {k: v for k, v in config.to_dict().items() if k not in FP16_FIELDS}
    assert "master_weights" not in config.scaler_dict() and config.scaler_dict()["hysteresis"] == 2
