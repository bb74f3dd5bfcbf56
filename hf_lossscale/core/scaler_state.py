"""`ScalerState`: a loss scaler's state as 0-d device tensors, its checkpoint format, and its checks.

The nine values are spelled once, in `FIELDS`; creating them on a device, reading them back in one
transfer, writing and loading a checkpoint, and resetting all go through that table. Imports only
torch.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch

from .config import FP16_FIELDS, INT32_MAX, INT64_MAX, SCALE_MAX, SCALE_MIN, LossScaleConfig

__all__ = [
    "FIELDS",
    "STATE_FORMAT",
    "STATE_FORMAT_VERSION",
    "ScalerState",
    "StepCounts",
    "validate_state_dict",
]

STATE_FORMAT = "hf_lossscale.DynamicLossScaler"
STATE_FORMAT_VERSION = 1

#: State-dict key -> dtype of the device tensor. The first two keys (and `scale`'s float) are the ones
#: `torch.amp.GradScaler` writes; the rest are ours.
FIELDS: dict[str, torch.dtype] = {
    "scale": torch.float32,
    "_growth_tracker": torch.int32,
    "_hysteresis_tracker": torch.int32,
    "total_steps": torch.int64,
    "skipped_steps": torch.int64,
    "consecutive_skips": torch.int64,
    "last_step_skipped": torch.bool,
    # steps skipped because the loss itself was non-finite (a forward overflow), and how many in a row
    "nonfinite_loss_steps": torch.int64,
    "consecutive_nonfinite_loss": torch.int64,
}
_COUNTERS = (
    "_hysteresis_tracker",
    "total_steps",
    "skipped_steps",
    "consecutive_skips",
    "nonfinite_loss_steps",
    "consecutive_nonfinite_loss",
)
#: The step counters, held in one int64 device vector (`ScalerState.counters`, in this order) of which
#: the state's tensors are 0-d views: one update advances all of them in two ops.
PACKED = (
    "consecutive_skips",
    "consecutive_nonfinite_loss",
    "total_steps",
    "skipped_steps",
    "nonfinite_loss_steps",
)
#: Keys a state written before they existed lacks: they load as 0.
_ADDED_LATER = ("nonfinite_loss_steps", "consecutive_nonfinite_loss")
_CONFIG_KEYS = ("growth_factor", "backoff_factor", "growth_interval")  # GradScaler writes these too


class StepCounts(NamedTuple):
    """The scaler's step counters, read together (`DynamicLossScaler.counts()`): optimizer steps
    (`update()` calls), those skipped, those skipped on a non-finite loss, and the two streaks."""

    total_steps: int
    skipped_steps: int
    nonfinite_loss_steps: int
    consecutive_skips: int
    consecutive_nonfinite_loss: int

    @property
    def applied_steps(self) -> int:
        """Steps the optimizers applied: `total_steps - skipped_steps`."""
        return self.total_steps - self.skipped_steps


def _python(key: str, value: float) -> Any:
    dtype = FIELDS[key]
    return float(value) if dtype.is_floating_point else bool(value) if dtype is torch.bool else int(value)


class ScalerState:
    """The scale, the growth and hysteresis trackers, the step counters and the last skip flag.

    Until `materialise(device)` the values live on the host (`host`); afterwards they are 0-d tensors
    on that device, read with `state["scale"]` and written in place (or, for `last_step_skipped`,
    replaced with `state.replace(...)`).
    """

    def __init__(self, config: LossScaleConfig) -> None:
        self.host: dict[str, Any] = self.initial(config)
        self.tensors: dict[str, torch.Tensor] | None = None
        #: The `PACKED` counters as one int64 vector on the device (None before `materialise`).
        self.counters: torch.Tensor | None = None
        #: Module names `fp32_modules="auto"` moved to FP32 in this run (kept in the checkpoint).
        self.fp32_modules: list[str] = []

    @staticmethod
    def initial(config: LossScaleConfig) -> dict[str, Any]:
        """A fresh state's values for `config`."""
        start = {"scale": 1.0 if config.mode == "off" else config.init_scale}
        start["_hysteresis_tracker"] = config.hysteresis
        return {key: _python(key, start.get(key, 0)) for key in FIELDS}

    # ------------------------------------------------------------------ device tensors
    def __getstate__(self) -> dict[str, Any]:
        """Pickle writes each tensor with its own storage, so the counters' 0-d views would come back
        as copies that no update advances: they are left out and made again from `counters`."""
        state = self.__dict__.copy()
        if self.tensors is not None:
            state["tensors"] = {k: v for k, v in self.tensors.items() if k not in PACKED}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.tensors is not None and self.counters is not None:
            kept = self.tensors
            self.tensors = {k: self.counters[PACKED.index(k)] if k in PACKED else kept[k] for k in FIELDS}

    @property
    def materialised(self) -> bool:
        return self.tensors is not None

    @property
    def device(self) -> torch.device | None:
        return self.tensors["scale"].device if self.tensors is not None else None

    def materialise(self, device: torch.device) -> None:
        """Create (or re-create) the device tensors from the host values."""
        self.counters = torch.tensor([self.host[k] for k in PACKED], dtype=torch.int64, device=device)
        self.tensors = {
            key: self.counters[PACKED.index(key)]
            if key in PACKED
            else torch.full((), self.host[key], dtype=dtype, device=device)
            for key, dtype in FIELDS.items()
        }

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def replace(self, key: str, tensor: torch.Tensor) -> None:
        self.tensors[key] = tensor

    def value(self, key: str) -> Any:
        """One value as a Python number (reads the device once materialised: a sync)."""
        return self.host[key] if self.tensors is None else _python(key, self.tensors[key].item())

    def set(self, key: str, value: Any) -> None:
        """Write one value, on the device once materialised (in place: views stay valid)."""
        if self.tensors is None:
            self.host[key] = _python(key, value)
        else:
            self.tensors[key].fill_(value)

    def set_scale(self, new_scale: float | torch.Tensor) -> None:
        """Set the scale by hand (`update(new_scale)`): a float in FP32's normal range, or a 1-element
        tensor without grad."""
        if isinstance(new_scale, torch.Tensor):
            if new_scale.numel() != 1 or new_scale.requires_grad:
                raise ValueError("new_scale must be a float or a 1-element tensor without grad.")
            self.tensors["scale"].copy_(new_scale.reshape(()))
        else:
            value = float(new_scale)
            if not (SCALE_MIN <= value <= SCALE_MAX):
                raise ValueError(
                    f"update(new_scale={new_scale!r}): need a number in FP32's normal range [2**-126, FP32 max], "
                    "where the scale and its reciprocal are finite."
                )
            self.tensors["scale"].fill_(value)

    def stats(self, enabled: bool = True) -> dict[str, Any]:
        """The scale and counters under their public names (`DynamicLossScaler.stats()`), in one
        transfer; the scale reads 1.0 when scaling is off (`enabled=False`)."""
        v = self.host_values()
        return {
            "loss_scale": v["scale"] if enabled else 1.0,
            "total_steps": v["total_steps"],
            "skipped_steps": v["skipped_steps"],
            "consecutive_skips": v["consecutive_skips"],
            "growth_tracker": v["_growth_tracker"],
            "hysteresis_tracker": v["_hysteresis_tracker"],
            "last_step_skipped": v["last_step_skipped"],
            "nonfinite_loss_steps": v["nonfinite_loss_steps"],
            "consecutive_nonfinite_loss": v["consecutive_nonfinite_loss"],
        }

    def counts(self) -> StepCounts:
        """The step counters, in one device-to-host transfer of `counters` (none before `materialise`)."""
        if self.counters is None:
            return StepCounts(**{k: self.host[k] for k in StepCounts._fields})
        return StepCounts(**{k: int(v) for k, v in zip(PACKED, self.counters.tolist(), strict=True)})

    def reset(self, config: LossScaleConfig) -> None:
        """Back to a fresh state for `config`, on the same device if there is one."""
        self.host = self.initial(config)
        self.fp32_modules = []
        if self.tensors is not None:
            self.materialise(self.device)

    def host_values(self) -> dict[str, Any]:
        """All values as Python numbers, in one device-to-host transfer (none before `materialise`)."""
        if self.tensors is None:
            return dict(self.host)
        packed = torch.stack([t.double() for t in self.tensors.values()]).tolist()
        return {key: _python(key, v) for key, v in zip(FIELDS, packed, strict=True)}

    # ------------------------------------------------------------------ checkpoint format
    def state_dict(self, config: LossScaleConfig) -> dict[str, Any]:
        """A superset of `torch.amp.GradScaler.state_dict()`: the values, the scaler's config
        (`LossScaleConfig.scaler_dict()`: not the model's FP16 handling) and the format."""
        values = self.host_values()
        return {
            "scale": values["scale"],
            **{key: getattr(config, key) for key in _CONFIG_KEYS},
            **{key: values[key] for key in FIELDS if key != "scale"},
            "config": config.scaler_dict(),  # the model's FP16 handling is not the scaler's
            "fp32_modules": list(self.fp32_modules),
            "format": STATE_FORMAT,
            "format_version": STATE_FORMAT_VERSION,
        }

    def load_state_dict(self, state_dict: dict[str, Any], config: LossScaleConfig) -> LossScaleConfig:
        """Take the values of a state written by `state_dict()` or by `torch.amp.GradScaler`, and
        return the config to run with.

        The growth factor, backoff factor and growth interval come back from the state, as
        `torch.amp.GradScaler.load_state_dict` restores them (a warning names those that change);
        the rest of `config` stays in force: where the checkpoint's config differs a warning names
        the fields, a scale outside `[min_scale, max_scale]` is clamped with a warning, static and
        off modes keep their own scale. A malformed state raises `ValueError` naming the missing or
        wrong keys.
        """
        state = validate_state_dict(state_dict)
        #: Modules `fp32_modules="auto"` moved to FP32 in the run that wrote the state.
        self.fp32_modules = state.pop("fp32_modules")
        config = _restore_torch_fields(state_dict, config)
        _warn_config_differs(state.pop("config", None), state_dict, config)
        state["scale"] = _scale_for(config, state["scale"])
        if state["_hysteresis_tracker"] is None or state["_hysteresis_tracker"] > config.hysteresis:
            state["_hysteresis_tracker"] = config.hysteresis  # torch's state: a full budget
        self.host = state
        if self.tensors is not None:
            self.materialise(self.device)
        return config


def _restore_torch_fields(state_dict: dict[str, Any], config: LossScaleConfig) -> LossScaleConfig:
    """`config` with the fields torch's state carries (`_CONFIG_KEYS`) taken from the state."""
    restored = {k: state_dict[k] for k in _CONFIG_KEYS if k in state_dict}
    changed = {k: v for k, v in restored.items() if v != getattr(config, k)}
    if not changed:
        return config
    try:
        new = config.replace(**changed)
    except ValueError as e:
        raise ValueError(f"Loss-scaler state: {e}") from None
    warnings.warn(
        f"Restored from the loss-scaler state, as torch.amp.GradScaler does: {changed} (the config had "
        f"{ {k: getattr(config, k) for k in changed} }). Call set_growth_factor/set_backoff_factor/"
        "set_growth_interval after loading to change them.",
        stacklevel=4,
    )
    return new


def _warn_config_differs(
    saved: dict[str, Any] | None, state_dict: dict[str, Any], config: LossScaleConfig
) -> None:
    if saved is not None:
        current = config.scaler_dict()
        differing = sorted(k for k, v in saved.items() if current.get(k, v) != v)
        if differing:
            warnings.warn(
                "Loaded loss-scaler state was written with a different config; the current one "
                f"applies. Differing fields: {differing} (checkpoint: "
                f"{ {k: saved[k] for k in differing} }).",
                stacklevel=4,
            )
        return
    for key in _CONFIG_KEYS:
        if key in state_dict and state_dict[key] != getattr(config, key):
            warnings.warn(
                f"GradScaler state has {key}={state_dict[key]!r}; the current config's "
                f"{key}={getattr(config, key)!r} applies.",
                stacklevel=4,
            )


def _scale_for(config: LossScaleConfig, scale: float) -> float:
    """The scale a restored state starts from under `config`."""
    if config.mode == "off":
        return 1.0
    if config.mode == "static":
        if scale != config.init_scale:
            warnings.warn(
                f"Static mode keeps scale={config.init_scale:g}; the checkpoint's scale {scale:g} is not used.",
                stacklevel=4,
            )
        return config.init_scale
    if not (config.min_scale <= scale <= config.max_scale):
        clamped = min(max(scale, config.min_scale), config.max_scale)
        warnings.warn(
            f"Restored scale {scale:g} is outside [min_scale, max_scale] = "
            f"[{config.min_scale:g}, {config.max_scale:g}]; using {clamped:g}.",
            stacklevel=4,
        )
        return clamped
    return scale


def validate_state_dict(state_dict: Any) -> dict[str, Any]:
    """Check a scaler state dict (ours or torch's) and return its values by `FIELDS` key (plus
    `config` for ours). torch's has no hysteresis tracker: it comes back as None (a full budget)."""
    if not isinstance(state_dict, dict):
        raise ValueError(f"Loss-scaler state must be a dict, got {type(state_dict).__name__}.")
    if not state_dict:
        raise ValueError(
            "Loss-scaler state dict is empty (a disabled torch GradScaler writes one). To start a "
            "fresh scaler on purpose, do not load it."
        )
    ours = state_dict.get("format") == STATE_FORMAT
    if ours and state_dict.get("format_version", STATE_FORMAT_VERSION) != STATE_FORMAT_VERSION:
        raise ValueError(
            f"Loss-scaler state has format_version={state_dict.get('format_version')!r}; this hf_lossscale "
            f"reads version {STATE_FORMAT_VERSION} (written by a newer release?)."
        )
    if not ours and "format" in state_dict:
        raise ValueError(f"Loss-scaler state has an unknown format={state_dict['format']!r}.")
    dropped = sorted(k for k in FIELDS if k not in ("scale", "_growth_tracker") and k in state_dict)
    if not ours and dropped:
        warnings.warn(
            f"Loss-scaler state without a `format` key but with {dropped}: loaded as a torch.amp.GradScaler "
            "state (scale and growth tracker only); those counters are dropped.",
            stacklevel=4,
        )
    required = (
        tuple(k for k in (*FIELDS, *_CONFIG_KEYS, "config") if k not in _ADDED_LATER)
        if ours
        else ("scale", "_growth_tracker")
    )
    missing = [k for k in required if k not in state_dict]
    if missing:
        kind = "hf_lossscale" if ours else "torch.amp.GradScaler"
        raise ValueError(
            f"Malformed {kind} scaler state: missing key(s) {missing}; has {sorted(state_dict)}."
        )
    wrong = []
    scale = state_dict["scale"]
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        scale = scale.item()
    if (
        not isinstance(scale, (int, float))
        or isinstance(scale, bool)
        or not (SCALE_MIN <= scale <= SCALE_MAX)
    ):
        wrong.append(f"scale={scale!r} (need a number in FP32's normal range [2**-126, FP32 max])")
    ints = ("_growth_tracker", *_COUNTERS) if ours else ("_growth_tracker",)
    values: dict[str, Any] = {}
    for key in ints:
        v = state_dict.get(key, 0)
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        limit = INT32_MAX if FIELDS[key] is torch.int32 else INT64_MAX
        if not isinstance(v, int) or isinstance(v, bool) or not (0 <= v <= limit):
            bits = 32 if limit == INT32_MAX else 64
            wrong.append(
                f"{key}={v!r} (need an integer in [0, 2**{bits - 1} - 1]: an int{bits} on the device)"
            )
        values[key] = v
    if ours and not isinstance(state_dict["last_step_skipped"], bool):
        wrong.append(f"last_step_skipped={state_dict['last_step_skipped']!r} (need a bool)")
    fp32_modules = state_dict.get("fp32_modules", [])
    if not isinstance(fp32_modules, (list, tuple)) or not all(isinstance(m, str) for m in fp32_modules):
        wrong.append(f"fp32_modules={fp32_modules!r} (need a list of module names)")
    config = None
    if ours:
        saved = state_dict["config"]
        if isinstance(saved, dict):  # written before FP16Config: those fields are the model's, not compared
            saved = {k: v for k, v in saved.items() if k not in FP16_FIELDS}
        try:
            config = LossScaleConfig.from_dict(saved, source="scaler state 'config'").scaler_dict()
        except ValueError as err:
            wrong.append(str(err))
    if wrong:
        raise ValueError("Malformed loss-scaler state: " + "; ".join(wrong) + ".")
    out = {
        "scale": float(scale),
        "_growth_tracker": values["_growth_tracker"],
        "_hysteresis_tracker": values.get("_hysteresis_tracker"),  # None: a full budget
        **{key: values.get(key, 0) for key in _COUNTERS[1:]},
        "last_step_skipped": bool(state_dict.get("last_step_skipped", False)),
    }
    if config is not None:
        out["config"] = config
    out["fp32_modules"] = list(fp32_modules) if isinstance(fp32_modules, (list, tuple)) else []
    return out
