"""`LossScaleConfig`: the configuration of hf_lossscale, and `FP16Config`, its part about the model.

`LossScaleConfig` holds every setting a user gives (one object, one flag and one environment
variable per field). Two concerns meet in it: the scaler's update rule and collapse policy, which
the scaler's checkpoint carries (`LossScaleConfig.scaler_dict()`), and how the model runs in FP16
around it (`FP16_FIELDS`: CPU emulation, FP32 modules, master weights), which `config.fp16` gives
as an `FP16Config` of its own and which no scaler checkpoint carries.

This module imports neither torch nor transformers, so configs can be built, validated and
serialised anywhere (a launcher, a CLI, a config check in CI).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "FP16_FIELDS",
    "FP16Config",
    "LossScaleConfig",
    "MODES",
    "FP16_ON_CPU",
    "AT_MIN_SCALE",
    "AUTO",
    "ENV_PREFIX",
    "ENV_CONFIG_FILE",
    "resolve_config",
]

MODES = ("dynamic", "static", "off")
FP16_ON_CPU = ("emulate", "native")
#: What happens when skipped steps pile up at the floor (`at_min_scale`).
AT_MIN_SCALE = ("raise", "warn", "clamp")
#: `master_weights` values besides True and False (`"auto"`: True exactly when a trainable parameter is FP16).
MASTER_WEIGHT_MODES = ("auto", "kahan", "stochastic_rounding")
#: The `fp32_modules` entry that lets a diagnosed forward overflow add its origin module.
AUTO = "auto"
#: The `LossScaleConfig` fields about the model's FP16 handling (`FP16Config`), not the scaler's rule.
FP16_FIELDS = ("fp16_on_cpu", "fp32_modules", "max_auto_fp32_modules", "master_weights")


def _q(value: Any, limit: int = 120) -> str:
    """`repr(value)`, capped: a value quoted in an error stays readable whatever its size (a YAML alias
    expansion, a file read by mistake)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


#: The scales a config accepts: FP32's normal range, where a scale and its reciprocal are finite.
SCALE_MIN = 2.0**-126
SCALE_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max, spelled out: this module is torch-free
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

#: Per-field environment variables are ``HF_LOSSSCALE_<FIELD NAME IN CAPITALS>``.
ENV_PREFIX = "HF_LOSSSCALE_"
#: Environment variable naming a YAML or JSON config file.
ENV_CONFIG_FILE = "HF_LOSSSCALE_CONFIG"
#: Variables in our namespace that are not scaler settings: where the tests and benchmarks find the
#: benchmark data, and whether its absence fails them (CI) or skips them; the masters' CPU kernel switch.
ENV_NOT_CONFIG = ("HF_LOSSSCALE_DATA", "HF_LOSSSCALE_REQUIRE_DATA", "HF_LOSSSCALE_CHECK_LOCK",
                  "HF_LOSSSCALE_CPU_KERNEL")  # fmt: skip


def _is_bool(value: Any) -> bool:
    kind = type(value)
    return isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


def _is_int(value: Any) -> bool:
    """An integer: Python's or numpy's (`numbers.Integral`), not a bool."""
    return isinstance(value, numbers.Integral) and not _is_bool(value)


def _is_number(value: Any) -> bool:
    """A real number: Python's or numpy's (`numbers.Real`), not a bool."""
    return isinstance(value, numbers.Real) and not _is_bool(value)


def _number_hint(value: Any) -> str:
    """For a string that reads as a number: YAML 1.1 (PyYAML) reads `1e4` as a string."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return (
            f" It is the string {value!r}: YAML (PyYAML, YAML 1.1) reads exponents without a dot or sign "
            "such as 1e4 as strings; write 1.0e+4 or 10000."
        )
    return ""


def _normalise_numbers(config: Any) -> None:
    """numpy scalars (and other `numbers` types) as plain Python ints and floats, before validation."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if _is_bool(value) and not isinstance(value, bool):
            setattr(config, f.name, bool(value))
        elif _is_int(value) and type(value) is not int:
            setattr(config, f.name, int(value))
        elif _is_number(value) and not isinstance(value, (int, float)):
            setattr(config, f.name, float(value))


@dataclass
class LossScaleConfig:
    """Configuration of a [`DynamicLossScaler`].

    Args:
        mode (`str`, *optional*, defaults to `"dynamic"`):
            `"dynamic"` (back off on overflow, grow after a clean streak), `"static"` (the scale stays
            at `init_scale`; non-finite steps are still skipped and counted) or `"off"` (scale 1, no
            checks, every step applied: FP16 without loss scaling).
        init_scale (`float`, *optional*, defaults to `2**16`): starting scale.
        growth_factor (`float`, *optional*, defaults to `2.0`):
            multiplies the scale after `growth_interval` clean steps in a row. Must be > 1.
        backoff_factor (`float`, *optional*, defaults to `0.5`):
            multiplies the scale on overflow (once the hysteresis budget is used up). In (0, 1).
        growth_interval (`int`, *optional*, defaults to `2000`): clean steps in a row before growth.
        min_scale (`float`, *optional*, defaults to `1.0`): floor; backoff never goes below it.
        max_scale (`float`, *optional*, defaults to `2**24`): ceiling; growth never goes above it.
        hysteresis (`int`, *optional*, defaults to `1`):
            overflowing steps tolerated before a backoff (1 backs off on every overflow, as torch does,
            and leaves the hysteresis tracker full: there is no budget to count down).
        consecutive_hysteresis (`bool`, *optional*, defaults to `False`):
            refill the hysteresis budget on every clean step (DeepSpeed's option) instead of only when
            the scale grows (Megatron's rule).
        max_consecutive_skips (`int` or `None`, *optional*, defaults to `100`):
            raise `LossScaleCollapseError` after this many skipped steps in a row; `None` disables.
        telemetry_interval (`int`, *optional*, defaults to 100):
            every this many optimizer steps, histogram the scaled gradients' binary exponents on
            the device (see `hf_lossscale.core.telemetry`; read only at log steps). 0 disables it.
        fp16_on_cpu (`str`, *optional*, defaults to `"emulate"`):
            how an FP16 run on a CPU computes: `"emulate"` (FP16 numerics at FP32 speed, see
            `fp16_emulation`) or `"native"` (real `torch.autocast("cpu", float16)`, ~20x slower).
            Never used on CUDA, where autocast is real.
        backoff_on_nonfinite_loss (`bool`, *optional*, defaults to `False`):
            a step whose *loss* is non-finite (an overflow in the forward pass, which no scale can fix)
            is skipped and counted (`nonfinite_loss_steps`) but leaves the scale, the growth and the
            hysteresis trackers as they were. `True` backs off as on any overflow (torch's rule).
        fp32_modules (`tuple[str, ...]`, *optional*, defaults to `()`):
            module-name patterns (a dotted name, a dotted suffix such as `"attention.self"`, or an
            `fnmatch` pattern such as `"*.layer.3.*"`) whose forward runs outside autocast with floating
            inputs upcast to FP32; merged with the model's own `_keep_in_fp32_modules`. A string is
            split at commas. `"auto"` adds, from the next step on, each module diagnosed as the
            origin of a forward overflow (kept in the checkpoint).
        max_auto_fp32_modules (`int`, *optional*, defaults to `8`):
            the most modules `"auto"` adds to FP32 in one run; the one refused beyond it is named.
        at_min_scale (`str`, *optional*, defaults to `"raise"`):
            after `max_consecutive_skips` skips in a row: `"raise"` (`LossScaleCollapseError`),
            `"warn"` (warn once and keep skipping), or `"clamp"` (at the floor, stop skipping: the
            non-finite gradient elements are clamped, NaN to 0 and +-inf to +-65504 / scale, and the
            optimizer steps; costs one host read of the overflow flag per step).
        master_weights (`bool` or `str`, *optional*, defaults to `"auto"`):
            how the optimizer updates trainable FP16 parameters (a model held in FP16). `"auto"` /
            `True`: it steps on FP32 copies (the masters), reading each FP16 gradient once into them
            and writing the FP16 weights back after each step (`"auto"`: on exactly when a trainable
            parameter is FP16). Below that memory: `"kahan"` (FP16 weights plus an FP16 compensation
            buffer: the update's rounding error is carried to the next step) and
            `"stochastic_rounding"` (the FP32 update rounded stochastically into the FP16 weight,
            seeded; the random state travels in the optimizer's state). `False`: such a parameter
            is refused with the remedies (torch's "Attempting to unscale FP16 gradients", explained).
            A string that spells a boolean (`"true"`/`"on"`/`"yes"`/`"1"`, `"false"`/`"off"`/`"no"`/
            `"0"`, any case) is read as that boolean, as the `--loss_scale_master_weights` flag and
            `HF_LOSSSCALE_MASTER_WEIGHTS` read it; any other string is refused.
        floor_event_steps (`int`, *optional*, defaults to `100`):
            an event (and a warning) when the scale has sat at `min_scale` for this many optimizer
            steps in a row. 0 disables it.

    Four of these fields (`fp16_on_cpu`, `fp32_modules`, `max_auto_fp32_modules`, `master_weights`)
    are the model's FP16 handling rather than the scaler's: `config.fp16` gives them
    as an `FP16Config`, and a scaler's checkpoint carries only the rest (`scaler_dict()`), so a
    resumed run may change them without a word.

    Example:

    ```python
    >>> from hf_lossscale import LossScaleConfig
    >>> config = LossScaleConfig(init_scale=2.0**12, min_scale=16.0, hysteresis=2)
    >>> LossScaleConfig.from_dict(config.to_dict()) == config
    True
    ```
    """

    mode: str = field(default="dynamic", metadata={"help": f"One of {MODES}."})
    init_scale: float = field(default=2.0**16, metadata={"help": "Starting loss scale."})
    growth_factor: float = field(
        default=2.0, metadata={"help": "Scale multiplier after `growth_interval` clean steps (> 1)."}
    )
    backoff_factor: float = field(default=0.5, metadata={"help": "Scale multiplier on overflow, in (0, 1)."})
    growth_interval: int = field(
        default=2000, metadata={"help": "Clean steps in a row before the scale grows (>= 1)."}
    )
    min_scale: float = field(default=1.0, metadata={"help": "Floor of the scale."})
    max_scale: float = field(default=2.0**24, metadata={"help": "Ceiling of the scale."})
    hysteresis: int = field(
        default=1, metadata={"help": "Overflowing steps tolerated before a backoff (>= 1)."}
    )
    consecutive_hysteresis: bool = field(
        default=False,
        metadata={"help": "Refill the hysteresis budget on every clean step (DeepSpeed's rule)."},
    )
    max_consecutive_skips: int | None = field(
        default=100,
        metadata={"help": "Raise LossScaleCollapseError after this many skips in a row (None: never)."},
    )
    telemetry_interval: int = field(
        default=100,
        metadata={
            "help": "Gradient exponent histograms (FP16 number line) every N optimizer steps (0: off)."
        },
    )

    fp16_on_cpu: str = field(
        default="emulate",
        metadata={
            "help": f"FP16 on a CPU: one of {FP16_ON_CPU} (emulated numerics at FP32 speed, or real autocast)."
        },
    )

    backoff_on_nonfinite_loss: bool = field(
        default=False,
        metadata={"help": "Back the scale off on a step whose loss is non-finite too (torch's rule)."},
    )
    fp32_modules: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "Module-name patterns run in FP32 (comma-separated; 'auto' adds each diagnosed "
            "forward-overflow origin)."
        },
    )
    max_auto_fp32_modules: int = field(
        default=8, metadata={"help": "The most modules fp32_modules='auto' adds in one run (>= 1)."}
    )
    at_min_scale: str = field(
        default="raise",
        metadata={"help": f"After max_consecutive_skips skips in a row: one of {AT_MIN_SCALE}."},
    )
    floor_event_steps: int = field(
        default=100,
        metadata={"help": "Event when the scale sits at min_scale this many steps in a row (0: off)."},
    )
    master_weights: bool | str = field(
        default="auto",
        metadata={
            "help": "FP32 master weights for trainable FP16 parameters: 'auto' (on exactly when one is "
            "FP16), true, 'kahan' (FP16 weights + an FP16 compensation buffer), 'stochastic_rounding' "
            "(FP16 weights, updates rounded stochastically), or false (FP16 parameters refused)."
        },
    )

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check every field; raise `ValueError` naming the field, the value and the allowed range."""
        _normalise_numbers(self)
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise ValueError(f"LossScaleConfig.mode={_q(self.mode)} is not one of {MODES}.")
        for name in ("init_scale", "min_scale", "max_scale"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"LossScaleConfig.{name}={_q(value)} must be a finite number > 0.{_number_hint(value)}"
                )
            if not (SCALE_MIN <= value <= SCALE_MAX):
                # below FP32's smallest normal number the reciprocal used to unscale overflows to inf
                # (clean gradients would unscale to inf and be stepped); above FP32's largest the scale
                # itself is inf and every step is skipped
                raise ValueError(
                    f"LossScaleConfig.{name}={_q(value)} is outside FP32's normal range "
                    f"[2**-126, FP32 max] = [{SCALE_MIN!r}, {SCALE_MAX!r}], where the scale and its "
                    "reciprocal are both finite FP32 numbers."
                )
            setattr(self, name, float(value))
        gf = self.growth_factor
        if not _is_number(gf) or not math.isfinite(gf) or gf <= 1:
            raise ValueError(
                f"LossScaleConfig.growth_factor={_q(gf)} must be a finite number > 1.{_number_hint(gf)}"
            )
        self.growth_factor = float(gf)
        bf = self.backoff_factor
        if not _is_number(bf) or not (0 < bf < 1):
            raise ValueError(
                f"LossScaleConfig.backoff_factor={_q(bf)} must be a number in the open interval (0, 1).{_number_hint(bf)}"
            )
        self.backoff_factor = float(bf)
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if not _is_int(value) or not (1 <= value <= INT32_MAX):
                # the trackers are int32 device tensors: beyond 2**31 - 1 the comparison wraps
                raise ValueError(
                    f"LossScaleConfig.{name}={_q(value)} must be an integer in [1, 2**31 - 1] "
                    "(its tracker is an int32 on the device)."
                )
        if not isinstance(self.consecutive_hysteresis, bool):
            raise ValueError(
                f"LossScaleConfig.consecutive_hysteresis={_q(self.consecutive_hysteresis)} "
                "must be True or False."
            )
        mcs = self.max_consecutive_skips
        if mcs is not None and (not _is_int(mcs) or not (1 <= mcs <= INT64_MAX)):
            raise ValueError(
                f"LossScaleConfig.max_consecutive_skips={_q(mcs)} must be an integer in [1, 2**63 - 1], "
                "or None to disable the collapse check."
            )
        ti = self.telemetry_interval
        if not _is_int(ti) or not (0 <= ti <= INT64_MAX):
            raise ValueError(
                f"LossScaleConfig.telemetry_interval={_q(ti)} must be an integer >= 0 (0 disables)."
            )
        _check_fp16_on_cpu(self.fp16_on_cpu, "LossScaleConfig")
        if not isinstance(self.backoff_on_nonfinite_loss, bool):
            raise ValueError(
                f"LossScaleConfig.backoff_on_nonfinite_loss={_q(self.backoff_on_nonfinite_loss)} "
                "must be True or False."
            )
        self.fp32_modules = _module_patterns(self.fp32_modules)
        _check_max_auto_fp32_modules(self.max_auto_fp32_modules, "LossScaleConfig")
        self.master_weights = _master_weights(self.master_weights, "LossScaleConfig")
        if not isinstance(self.at_min_scale, str) or self.at_min_scale not in AT_MIN_SCALE:
            raise ValueError(
                f"LossScaleConfig.at_min_scale={_q(self.at_min_scale)} is not one of {AT_MIN_SCALE}."
            )
        fe = self.floor_event_steps
        if not _is_int(fe) or not (0 <= fe <= INT64_MAX):
            raise ValueError(
                f"LossScaleConfig.floor_event_steps={_q(fe)} must be an integer >= 0 (0 disables)."
            )
        if self.min_scale > self.max_scale:
            raise ValueError(
                f"LossScaleConfig.min_scale={_q(self.min_scale)} is above "
                f"max_scale={self.max_scale!r}; need min_scale <= max_scale."
            )
        if not (self.min_scale <= self.init_scale <= self.max_scale):
            raise ValueError(
                f"LossScaleConfig.init_scale={_q(self.init_scale)} is outside "
                f"[min_scale, max_scale] = [{self.min_scale!r}, {self.max_scale!r}]."
            )

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """All fields as plain Python values (JSON- and YAML-safe: `fp32_modules` as a list)."""
        out = dataclasses.asdict(self)
        out["fp32_modules"] = list(self.fp32_modules)
        return out

    def scaler_dict(self) -> dict[str, Any]:
        """The scaler's own fields (the update rule, the collapse policy, what it observes) as plain
        values: what a scaler checkpoint carries and compares on resume. The model's FP16 handling
        (`FP16_FIELDS`, see `fp16`) is left out: a run may change it without touching the scaler."""
        return {k: v for k, v in self.to_dict().items() if k not in FP16_FIELDS}

    @property
    def fp16(self) -> FP16Config:
        """The model's FP16 handling (`fp16_on_cpu`, `fp32_modules`, `max_auto_fp32_modules`,
        `master_weights`) as an `FP16Config`: a frozen view, made from these fields when read (set
        them here, or with `replace(**fp16.to_dict())`)."""
        return FP16Config(**{name: getattr(self, name) for name in FP16_FIELDS})

    @property
    def auto_fp32(self) -> bool:
        """Whether `fp32_modules` holds `"auto"`."""
        return AUTO in self.fp32_modules

    @property
    def fp32_patterns(self) -> tuple[str, ...]:
        """The `fp32_modules` patterns, without `"auto"`."""
        return tuple(p for p in self.fp32_modules if p != AUTO)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "config") -> LossScaleConfig:
        """Build a config from a mapping; unknown keys are an error that names them."""
        if not isinstance(data, dict):
            raise ValueError(
                f"{source}: a loss-scale config must be a mapping of field names to values, "
                f"got {type(data).__name__}."
            )
        unknown = sorted(set(data) - set(cls.field_names()))
        if unknown:
            raise ValueError(
                f"{source}: unknown LossScaleConfig field(s) {unknown}; allowed: {list(cls.field_names())}."
            )
        try:
            return cls(**data)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> LossScaleConfig:
        """Load a YAML (`.yaml`/`.yml`) or JSON (`.json`) file holding a mapping of fields.

        YAML is read with `yaml.safe_load`. A file may also nest the fields under a top-level
        `loss_scale:` key, so one file can carry other settings too.
        """
        return cls.from_dict(config_section(read_config_file(path)), source=str(path))

    def to_file(self, path: str | os.PathLike) -> None:
        """Write the config as JSON or YAML, chosen by the file's suffix."""
        path = Path(path)
        if path.suffix in (".yaml", ".yml"):
            import yaml

            path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        else:
            path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def replace(self, **changes: Any) -> LossScaleConfig:
        """A validated copy with some fields changed."""
        unknown = sorted(set(changes) - set(self.field_names()))
        if unknown:
            raise ValueError(f"Unknown LossScaleConfig field(s) {unknown}.")
        return dataclasses.replace(self, **changes)

    def to_deepspeed_config(self) -> dict[str, Any]:
        """Deprecated: `hf_lossscale.integrations.deepspeed.to_deepspeed_config(config)`, which this calls.

        Kept for the scripts written against the release that had it; it warns (`FutureWarning`) and
        will be removed in a later release.
        """
        import warnings

        warnings.warn(
            "LossScaleConfig.to_deepspeed_config() is deprecated and will be removed: call "
            "hf_lossscale.integrations.deepspeed.to_deepspeed_config(config) instead.",
            FutureWarning,
            stacklevel=2,
        )
        # the one import from a higher tier in core/, for this deprecated call only (tests/test_layout.py)
        from ..integrations.deepspeed import to_deepspeed_config

        return to_deepspeed_config(self)


def _module_patterns(value: Any, owner: str = "LossScaleConfig") -> tuple[str, ...]:
    """`fp32_modules` as a tuple of non-empty names: a string is split at commas."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
        raise ValueError(
            f"{owner}.fp32_modules={_q(value)} must be module-name patterns: a list of strings, "
            "or one string of comma-separated names ('auto' for diagnosed forward-overflow origins)."
        )
    out = tuple(dict.fromkeys(v.strip() for v in items if v.strip()))
    bad = [v for v in out if any(c.isspace() for c in v)]
    if bad:
        raise ValueError(f"{owner}.fp32_modules: {bad} hold spaces; module names have none.")
    return out


def _check_fp16_on_cpu(value: Any, owner: str) -> None:
    if not isinstance(value, str) or value not in FP16_ON_CPU:
        raise ValueError(f"{owner}.fp16_on_cpu={_q(value)} is not one of {FP16_ON_CPU}.")


def _check_max_auto_fp32_modules(value: Any, owner: str) -> None:
    if not _is_int(value) or not (1 <= value <= INT64_MAX):
        raise ValueError(f"{owner}.max_auto_fp32_modules={_q(value)} must be an integer >= 1.")


def _master_weights(value: Any, owner: str) -> bool | str:
    """`master_weights` normalised: True, False, or one of `MASTER_WEIGHT_MODES` (strings read as
    booleans where they spell one, case and spaces ignored)."""
    text = value.strip().lower() if isinstance(value, str) else None
    if text in ("true", "on", "1", "yes"):
        return True
    if text in ("false", "off", "0", "no"):
        return False
    if text in MASTER_WEIGHT_MODES:
        return text
    if _is_bool(value):
        return bool(value)
    if not isinstance(value, bool):
        raise ValueError(
            f"{owner}.master_weights={_q(value)} must be True, False or one of {MASTER_WEIGHT_MODES}."
        )
    return value


@dataclass(frozen=True)
class FP16Config:
    """How the model runs in FP16 around the scaler: the part of `LossScaleConfig` that is not the
    scaler's rule (`config.fp16`; the fields, their defaults and their checks are the same). The
    scaler's checkpoint does not carry it, so a resumed run may change it freely.

    Args:
        fp16_on_cpu (`str`, *optional*, defaults to `"emulate"`): see `LossScaleConfig.fp16_on_cpu`.
        fp32_modules (`tuple[str, ...]`, *optional*, defaults to `()`): see `LossScaleConfig.fp32_modules`.
        max_auto_fp32_modules (`int`, *optional*, defaults to `8`): see
            `LossScaleConfig.max_auto_fp32_modules`.
        master_weights (`bool` or `str`, *optional*, defaults to `"auto"`): see
            `LossScaleConfig.master_weights`.

    Example:

    ```python
    >>> from hf_lossscale import LossScaleConfig
    >>> LossScaleConfig(master_weights="kahan", fp32_modules="lm_head").fp16
    FP16Config(fp16_on_cpu='emulate', fp32_modules=('lm_head',), max_auto_fp32_modules=8, master_weights='kahan')
    ```
    """

    fp16_on_cpu: str = "emulate"
    fp32_modules: tuple[str, ...] = ()
    max_auto_fp32_modules: int = 8
    master_weights: bool | str = "auto"

    def __post_init__(self) -> None:
        """Check every field as `LossScaleConfig` does; errors name `FP16Config.<field>`."""
        _check_fp16_on_cpu(self.fp16_on_cpu, "FP16Config")
        object.__setattr__(self, "fp32_modules", _module_patterns(self.fp32_modules, "FP16Config"))
        ma = self.max_auto_fp32_modules
        _check_max_auto_fp32_modules(ma, "FP16Config")
        object.__setattr__(self, "max_auto_fp32_modules", int(ma))
        object.__setattr__(self, "master_weights", _master_weights(self.master_weights, "FP16Config"))

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (`fp32_modules` as a list), as `LossScaleConfig.to_dict` gives them."""
        return {**dataclasses.asdict(self), "fp32_modules": list(self.fp32_modules)}

    @property
    def auto_fp32(self) -> bool:
        """Whether `fp32_modules` holds `"auto"`."""
        return AUTO in self.fp32_modules

    @property
    def fp32_patterns(self) -> tuple[str, ...]:
        """The `fp32_modules` patterns, without `"auto"`."""
        return tuple(p for p in self.fp32_modules if p != AUTO)


#: A config file is a few hundred bytes: more than this is something else (`/dev/zero`, a data file).
MAX_CONFIG_BYTES = 1 << 20
#: The most YAML nodes a config may expand to through its aliases (`&a` / `*a`): a few hundred bytes
#: of nested aliases otherwise expand to hundreds of millions of values.
MAX_CONFIG_NODES = 10_000


def read_config_file(path: str | os.PathLike, what: str = "loss-scale config") -> Any:
    """Parse a YAML or JSON file; errors name the file and are bounded in length: a file over
    `MAX_CONFIG_BYTES`, or YAML whose aliases expand past `MAX_CONFIG_NODES` values, is refused."""
    path = Path(path)
    shown = repr(str(path)) if len(str(path)) <= 300 else repr(str(path)[:300] + "...")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ValueError(f"Cannot read {what} file {shown}: {err.strerror or err}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(
            f"{what} file {shown} is over {MAX_CONFIG_BYTES} bytes: not a config file (a config is a "
            "mapping of a few fields)."
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"Cannot read {what} file {shown}: it is not UTF-8 text (a binary file?).") from None
    try:
        if path.suffix == ".json":
            return json.loads(text, object_pairs_hook=_no_duplicates)
        return _yaml_load(text)
    except _DuplicateKey as err:
        key = repr(err.args[0])
        key = key if len(key) <= 100 else key[:100] + "..."
        raise ValueError(f"{what} file {shown}: key {key} is given twice.") from None
    except _TooBig as err:
        raise ValueError(f"{what} file {shown}: {err}") from None
    except Exception as err:  # yaml.YAMLError / json.JSONDecodeError / RecursionError
        message = str(err) if not isinstance(err, RecursionError) else "nested too deeply"
        message = message if len(message) <= 500 else message[:500] + "..."
        raise ValueError(f"Cannot parse {what} file {shown}: {message}") from None


class _DuplicateKey(Exception):
    pass


class _TooBig(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _expanded_size(node: Any, sizes: dict[int, int]) -> int:
    """How many nodes `node` stands for once every alias is expanded (shared nodes counted once per
    use, each computed once); refuses a node that contains itself."""
    key = id(node)
    if key in sizes:
        if sizes[key] < 0:
            raise _TooBig("a YAML alias refers to a node that contains it (a recursive alias).")
        return sizes[key]
    sizes[key] = -1
    children = node.value if isinstance(node.value, list) else []
    total = 1
    for child in children:
        for part in child if isinstance(child, tuple) else (child,):
            total += _expanded_size(part, sizes)
            if total > MAX_CONFIG_NODES:
                raise _TooBig(
                    f"its YAML aliases expand to more than {MAX_CONFIG_NODES} values (nested aliases, a "
                    "'billion laughs'?); write the values out."
                )
    sizes[key] = total
    return total


def _yaml_load(text: str) -> Any:
    """`yaml.safe_load`, refusing a mapping that gives a key twice (PyYAML keeps the last silently)
    and aliases that expand past `MAX_CONFIG_NODES` values. A merge (`<<: *defaults`) is YAML's way
    to override: keys given beside it win over the merged ones."""
    import yaml

    class Loader(yaml.SafeLoader):
        def get_single_data(self):
            node = self.get_single_node()
            if node is None:
                return None
            _expanded_size(node, {})
            return self.construct_document(node)

    def mapping(loader, node, deep=False):
        own = sum(1 for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge")
        loader.flatten_mapping(node)  # the merged pairs first (the earliest merge last), then its own
        split = len(node.value) - own
        merged = {loader.construct_object(k, deep=deep): loader.construct_object(v, deep=deep)
                  for k, v in node.value[:split]}  # fmt: skip
        pairs = [
            (loader.construct_object(k, deep=deep), loader.construct_object(v, deep=deep))
            for k, v in node.value[split:]
        ]
        return {**merged, **_no_duplicates(pairs)}

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass


def config_section(data: Any) -> Any:
    """A config file's fields: the mapping under a top-level `loss_scale:` key when there is one (the
    file's other keys are other tools' settings), else the file's whole mapping."""
    if isinstance(data, dict) and isinstance(data.get("loss_scale"), dict):
        return data["loss_scale"]
    return data


# ---------------------------------------------------------------------- layered resolution
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"none", "null"}
#: Fields whose command-line flag and environment variable take 0 for None ("disable").
_ZERO_DISABLES = ("max_consecutive_skips",)


def _parse_env_value(name: str, var: str, raw: str) -> Any:
    """Parse one per-field environment variable by the field's declared type."""
    kind = {f.name: str(f.type) for f in dataclasses.fields(LossScaleConfig)}[name]
    text = raw.strip()
    if not text:  # a blank variable is a mistake, not "none": it would silently change the field
        raise ValueError(
            f"Environment variable {var} is set but empty: give it a value"
            + (" (or none)" if "None" in kind else "")
            + ", or unset it for the default."
        )
    try:
        if kind == "bool | str":  # master_weights: true / false / auto / kahan / stochastic_rounding
            return True if text.lower() in _TRUE else False if text.lower() in _FALSE else text
        if kind == "bool":
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError
        if "None" in kind and text.lower() in _NONE:
            return None
        if kind.startswith("int"):
            try:
                value = int(text)  # exact: 2**63 - 1 must not pass through a float
            except ValueError:
                number = float(text)  # "1e3"
                if not number.is_integer() or abs(number) > 2**53:
                    raise ValueError from None
                value = int(number)
            if value == 0 and name in _ZERO_DISABLES:
                return None  # as the --loss_scale_ flag: 0 disables
            return value
        if kind == "float":
            return float(text)
        return text  # str, and fp32_modules' comma-separated names
    except ValueError:
        expected = {"bool": "true/false", "float": "a number"}.get(
            kind, "an integer" if "int" in kind else kind
        )
        if "None" in kind:
            expected += " or none"
        raise ValueError(f"Environment variable {var}={_q(raw)}: expected {expected}.") from None


def config_from_env(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The fields set by `HF_LOSSSCALE_CONFIG` (a file) and `HF_LOSSSCALE_<FIELD>` variables.

    Per-field variables win over the file. Unknown `HF_LOSSSCALE_*` names are an error.
    """
    return {k: v for k, (v, _) in _env_layers(environ).items()}


def _env_layers(environ: dict[str, str] | None) -> dict[str, tuple[Any, str]]:
    """Field -> (value, where it was set), for the file and per-field environment layers."""
    environ = os.environ if environ is None else environ
    fields = LossScaleConfig.field_names()
    values: dict[str, tuple[Any, str]] = {}
    if ENV_CONFIG_FILE in environ:
        path = environ[ENV_CONFIG_FILE]
        if not path.strip():  # as a blank field variable: a mistake, not "no file"
            raise ValueError(
                f"Environment variable {ENV_CONFIG_FILE} is set but empty: name a YAML/JSON file, or unset it."
            )
        data = config_section(read_config_file(path))
        source = f"{ENV_CONFIG_FILE}={path}"
        LossScaleConfig.from_dict(data, source=source)  # validates; errors name the keys
        values.update({k: (v, source) for k, v in data.items()})
    for var, raw in environ.items():
        if not var.startswith(ENV_PREFIX) or var in (ENV_CONFIG_FILE, *ENV_NOT_CONFIG):
            continue
        name = var[len(ENV_PREFIX) :].lower()
        if name not in fields:
            allowed = [ENV_CONFIG_FILE] + [ENV_PREFIX + f.upper() for f in fields] + list(ENV_NOT_CONFIG)
            raise ValueError(f"Unknown environment variable {var}; hf_lossscale reads {allowed}.")
        values[name] = (_parse_env_value(name, var, raw), f"environment variable {var}")
    return values


def resolve_config(
    config: LossScaleConfig | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
    *,
    override_source: str | dict[str, str] = "argument",
) -> LossScaleConfig:
    """Build the effective config. Precedence, highest first:

    1. `config`, an explicit `LossScaleConfig` in code (used as is);
    2. `overrides`, fields the user set as arguments (e.g. the Trainer's `loss_scale_*`);
    3. per-field environment variables `HF_LOSSSCALE_<FIELD>`;
    4. the file named by `HF_LOSSSCALE_CONFIG`;
    5. the defaults.

    A bad value raises `ValueError` naming the field and where it was set (`override_source`: a
    word for all overrides, or a mapping from field to the name the user set it by, e.g. a flag).
    """
    if config is not None:
        if not isinstance(config, LossScaleConfig):
            raise TypeError(f"config must be a LossScaleConfig, got {type(config).__name__}.")
        return config
    layers = _env_layers(environ)
    for name, value in (overrides or {}).items():
        if value is not None:
            source = (
                override_source.get(name, name)
                if isinstance(override_source, dict)
                else f"{override_source} {name}"
            )
            layers[name] = (value, source)
    try:
        return LossScaleConfig(**{k: v for k, (v, _) in layers.items()})
    except ValueError as err:
        # Name where each field the message mentions came from: a cross-field error (min_scale above
        # max_scale, say) names both, the one a variable set and the one left at its default.
        text = str(err)
        mentioned = [n for n in LossScaleConfig.field_names() if re.search(rf"(?<![\w]){n}(?![\w])", text)]
        if len(mentioned) == 1 and mentioned[0] in layers:
            text += f" (set by {layers[mentioned[0]][1]})"
        elif any(n in layers for n in mentioned):
            parts = [
                f"{n} set by {layers[n][1]}" if n in layers else f"{n} at its default" for n in mentioned
            ]
            text += f" ({'; '.join(parts)})"
        raise ValueError(text) from None
