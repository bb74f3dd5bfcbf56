"""GRPO in FP16: TRL's `GRPOTrainer` under a `DynamicLossScaler`, a skipped step that advances
nothing, and the sampler/trainer mismatch measured while it trains.

Qi et al. (2025, arXiv 2510.26788) trace most of the gap between the policy that samples and the
policy that trains to BF16 rounding, and close it with FP16 plus a loss scaler. This module ties the
scaler to TRL's GRPO:

- `KVCacheSampler`, a `rollout_func` for `GRPOTrainer`: completions from `generate` with a KV cache
  (an inference path of its own, not the training forward), in a precision of its own (`"fp16"`,
  `"bf16"`, `"fp32"`, or `"auto"`: the trainer's). It samples with TRL's complete generation config
  (the processors stored in the model's `generation_config` neutralised, as TRL does), reports the
  log-probabilities of the distribution it sampled (the processed scores), and stops at every id in
  TRL's `eos_token_ids`.
- `FP16GRPOTrainer`: compares the sampler's log-probabilities (ours, vLLM's, or any `rollout_func`'s:
  what TRL holds as `sampling_per_token_logps`) with the trainer's for the same tokens, read from the
  training forward itself (a forward hook; no extra pass): per optimizer step the figures of
  `MISMATCH_FIGURES` (|Δ log p| mean/p95/max, the share outside the [0.9, 1.1] band, KL direct and
  k3, chi2 per token and per sequence, the log perplexity difference, the PPL ratio, the Pearson
  correlation of the probabilities), in the Trainer's logs (`mismatch/...`, so TensorBoard too) and
  the event log (a `mismatch` event per step), plus k3's drift per 100 steps (`MismatchDrift`), with
  a warning when it grows. `run_start` records both precisions; a warning says when they differ.
- A skipped step advances nothing: the LR scheduler is not stepped (as for every `LossScaleMixin`
  trainer), the reference-model sync counts applied steps only (TRL's `SyncRefModelCallback` is
  replaced), and TRL's micro-step counter is rolled back so the retried step reuses its generation
  batch where TRL would have. TRL's adaptive entropy controller (`use_adaptive_entropy`, TRL 1.16)
  is rolled back on a skipped step (its coefficient moves inside the loss, before the skip is known);
  `beta` is fixed and `top_entropy_quantile` a per-batch mask; a controller of your own can be a
  callback wrapped in `AppliedStepsOnly`. `state.global_step` counts optimizer steps attempted, as
  in every Hugging Face FP16 run (`max_steps`, logging and saving keep their meaning); each skip is a
  `grpo_skip` event.
- TRL's AsyncGRPO is refused (`FP16AsyncGRPOTrainer` says why).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any

import torch
from accelerate.utils import DistributedType
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from trl import GRPOTrainer
from trl.trainer.callbacks import SyncRefModelCallback

from ..fp16.emulation import fp16_emulation
from .accelerate_hook import effective_mixed_precision, fp16_context, plain_forward
from .callbacks import OverflowDiagnosisCallback
from .trainer import ASYNC_GRPO_REFUSAL, LossScaleMixin

logger = logging.getLogger(__name__)

__all__ = [
    "KVCacheSampler",
    "FP16GRPOTrainer",
    "AppliedStepsOnly",
    "mismatch_stats",
    "MismatchDrift",
    "MISMATCH_BAND",
    "MISMATCH_FIGURES",
    "eos_token_ids",
    "FP16AsyncGRPOTrainer",
]

#: The truncated importance-sampling band: tokens whose probability ratio leaves it are counted.
MISMATCH_BAND = (0.9, 1.1)
_PRECISIONS = ("auto", "fp16", "bf16", "fp32")


def trainer_precision(trainer: Any) -> str:
    """`"fp16"`, `"bf16"` or `"fp32"`: what the trainer's forward computes in."""
    mp = effective_mixed_precision(trainer.accelerator)
    return {"fp16": "fp16", "bf16": "bf16"}.get(mp, "fp32")


class KVCacheSampler:
    """A `rollout_func` for `GRPOTrainer`: completions from `model.generate` with a KV cache, in the
    sampler's own precision, and the log-probabilities of the tokens it drew.

    Args:
        precision: `"auto"` (the trainer's), `"fp16"`, `"bf16"` or `"fp32"`. FP16 on a CPU runs as the
            trainer's does (emulated by default, `fp16_emulation(policy="cuda")`); BF16 is autocast.
        attn_implementation: the attention kernel while sampling (`"eager"`, `"sdpa"`, ...; default:
            the model's own), restored afterwards.

    Unlike a vLLM sampler, it runs the same module and weights as the trainer (no weight sync, no
    separate kernels or batching): the gap it measures is the precision and the inference path
    (incremental decoding with a cache against one full forward), not a second engine. Prompts of
    different lengths are generated one length at a time, never padded (a warning says what TRL's
    padded training forward does to absolute position embeddings).
    """

    def __init__(self, precision: str = "auto", attn_implementation: str | None = None) -> None:
        if precision not in _PRECISIONS:
            raise ValueError(f"precision must be one of {_PRECISIONS}, got {precision!r}.")
        self.precision = precision
        #: an attention kernel of the sampler's own (e.g. "eager" against the trainer's "sdpa"), as a
        #: second inference engine has: the kernel differences that rounding then amplifies
        self.attn_implementation = attn_implementation
        self._warned_lengths = False
        self._warned_processors = False

    def resolved(self, trainer: Any) -> str:
        return trainer_precision(trainer) if self.precision == "auto" else self.precision

    def context(self, trainer: Any) -> contextlib.AbstractContextManager:
        precision, device = self.resolved(trainer), trainer.accelerator.device.type
        if precision == "bf16":
            return torch.autocast(device, dtype=torch.bfloat16)
        if precision == "fp16":
            if device == "cpu":  # the trainer's own CPU FP16 context when it has one, else emulation
                own = fp16_context(trainer.accelerator)
                return own() if own is not None else fp16_emulation("cuda")
            return torch.autocast(device, dtype=torch.float16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        tokenizer = trainer.processing_class
        texts = [
            p if isinstance(p, str) else tokenizer.apply_chat_template(p, tokenize=False) for p in prompts
        ]
        encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        lengths = sorted({len(ids) for ids in encoded})
        if len(lengths) > 1 and not self._warned_lengths:
            self._warned_lengths = True
            warnings.warn(
                f"Prompts of {len(lengths)} lengths in one batch: the sampler generates each length without "
                "padding, while TRL's training forward left-pads them, which shifts absolute position "
                "embeddings (the GPT-2 family: part of mismatch/ is then that) but not rotary ones (Llama, Qwen).",
                stacklevel=2,
            )
        model = trainer.accelerator.unwrap_model(trainer.model)
        was_training = model.training
        model.eval()
        own_attn = model.config._attn_implementation
        if self.attn_implementation is not None:
            model.set_attn_implementation(self.attn_implementation)
        completion_ids: list[list[int]] = [[] for _ in encoded]
        logprobs: list[list[float]] = [[] for _ in encoded]
        try:
            with plain_forward(model), self.context(trainer), _fp32_head(model, trainer):
                for length in lengths:  # one generate per prompt length: no padding, positions as trained
                    rows = [i for i, ids in enumerate(encoded) if len(ids) == length]
                    ids, lps = self._generate(model, trainer, [encoded[i] for i in rows])
                    for i, c, lp in zip(rows, ids, lps):
                        completion_ids[i], logprobs[i] = c, lp
        finally:
            model.train(was_training)
            if self.attn_implementation is not None:
                model.set_attn_implementation(own_attn)
        return {"prompt_ids": encoded, "completion_ids": completion_ids, "logprobs": logprobs}

    @staticmethod
    def generation_kwargs(trainer: Any) -> dict[str, Any]:
        """The complete generation config TRL samples with (`GRPOTrainer.generation_kwargs`): every
        processor TRL sets is given explicitly, so that none stored in the model's `generation_config`
        (Qwen2.5-Instruct ships `repetition_penalty=1.05`) applies, and generation stops at every id in
        TRL's `eos_token_ids` (the tokenizer's and the model's `generation_config.eos_token_id` list)."""
        tokenizer = trainer.processing_class
        args = trainer.args
        return {
            "max_new_tokens": trainer.max_completion_length,
            "do_sample": True,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": eos_token_ids(trainer),
            "temperature": trainer.temperature,
            "top_p": getattr(trainer, "top_p", args.top_p),
            "top_k": getattr(trainer, "top_k", args.top_k),
            "min_p": getattr(trainer, "min_p", args.min_p),
            "repetition_penalty": getattr(trainer, "repetition_penalty", args.repetition_penalty),
            "use_cache": True,
            **(args.generation_kwargs or {}),
        }

    def _generate(
        self, model: Any, trainer: Any, prompts: list[list[int]]
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Completions of equal-length `prompts` and the log-probabilities of their tokens under the
        distribution they were drawn from (the processed scores `generate` samples from: the
        temperature, and any processor TRL's config sets), each cut after its first end-of-sequence id."""
        from transformers import GenerationConfig

        input_ids = torch.tensor(prompts, device=trainer.accelerator.device)
        kwargs = self.generation_kwargs(trainer)
        self._warn_if_processed(kwargs)
        config = GenerationConfig(**kwargs, output_scores=True, return_dict_in_generate=True)
        stored = model.generation_config
        # the model's own generation_config fills whatever `generate` is not given (transformers merges it
        # under the passed config): replaced for the call, so that none of its processors applies
        model.generation_config = GenerationConfig(**kwargs)
        try:
            out = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
        finally:
            model.generation_config = stored
        completions = out.sequences[:, input_ids.shape[1] :]
        # the scores softmax-ed and sampled from (after every logits processor and warper)
        scores = torch.stack(out.scores, dim=1).float()  # (batch, new tokens, vocab)
        logps = torch.log_softmax(scores, dim=-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        stop = set(kwargs["eos_token_id"])
        completion_ids, logprobs = [], []
        for ids, lp in zip(completions.tolist(), logps.tolist()):
            end = next((i + 1 for i, t in enumerate(ids) if t in stop), len(ids))
            completion_ids.append(ids[:end])
            logprobs.append(lp[:end])
        return completion_ids, logprobs

    def _warn_if_processed(self, kwargs: dict[str, Any]) -> None:
        neutral = {"top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0}
        changed = {k: kwargs.get(k) for k, v in neutral.items() if kwargs.get(k) not in (v, None)}
        if changed and not self._warned_processors:
            self._warned_processors = True
            warnings.warn(
                f"The sampler draws from the distribution TRL's config processes ({changed}) and reports its "
                "log-probabilities; the training forward scores the unprocessed one (temperature only), so "
                "mismatch/ includes those processors as well as precision.",
                stacklevel=3,
            )


@contextlib.contextmanager
def _fp32_head(model: Any, trainer: Any):
    """With TRL's `cast_lm_head_to_fp32`, the head runs in FP32 while sampling too. TRL casts the head's
    weights and inputs to FP32, but under autocast (BF16, or FP16 on a GPU) `F.linear` is cast back to
    the autocast dtype; TRL's fused head computes the training log-probabilities outside autocast, so
    without this the sampler's head alone would run in BF16/FP16 (measured: BF16's mean |Δ log p|
    2.8x the uncast run's, `benchmarks/grpo_lm_head_fp32.py`)."""
    head = getattr(model, "lm_head", None)
    if not getattr(trainer.args, "cast_lm_head_to_fp32", False) or head is None:
        yield
        return
    device = trainer.accelerator.device.type
    inner, own = head.forward, "forward" in vars(head)  # TRL sets an instance attribute

    def forward(*args, **kwargs):
        with torch.autocast(device, enabled=False):
            return inner(*args, **kwargs)

    head.forward = forward
    try:
        yield
    finally:
        if own:
            head.forward = inner
        else:
            del head.forward


def eos_token_ids(trainer: Any) -> list[int]:
    """The ids that end a completion, as TRL reads them (`GRPOTrainer.eos_token_ids`): the tokenizer's
    end-of-sequence id and every id in the model's `generation_config.eos_token_id` (Llama 3's
    `<|eot_id|>` family)."""
    ids = getattr(trainer, "eos_token_ids", None)
    if ids is None:
        model = trainer.accelerator.unwrap_model(trainer.model)
        stored = model.generation_config.eos_token_id
        ids = [] if stored is None else [stored] if isinstance(stored, int) else list(stored)
        eos = trainer.processing_class.eos_token_id
        ids = ids if eos is None or eos in ids else [eos, *ids]
    return [int(i) for i in ids]


#: The mismatch figures per optimizer step (`mismatch/<key>` in the logs, keys of each `mismatch`
#: event), with how a log over several steps combines them. Δ = log p_trainer − log p_sampler per
#: sampled token, r = exp(Δ); a sequence's figures use its own tokens. verl's names in brackets.
MISMATCH_FIGURES: dict[str, str] = {
    "mean_abs_dlogp": "mean",  # mean |Δ|
    "p95_abs_dlogp": "mean",  # 95th percentile of |Δ|
    "max_abs_dlogp": "max",  # max |Δ|
    "outside_band_frac": "mean",  # share of tokens with r outside MISMATCH_BAND
    "kl": "mean",  # mean(−Δ): KL(sampler ‖ trainer), direct estimator (rollout_corr/kl)
    "k3_kl": "mean",  # mean(r − 1 − Δ): the same KL, k3 estimator, ≥ 0 (rollout_corr/k3_kl)
    "chi2_token": "mean",  # mean(r²) − 1 over tokens (rollout_corr/chi2_token)
    "chi2_seq": "mean",  # mean(R²) − 1 over sequences, R = exp(ΣΔ) (rollout_corr/chi2_seq)
    "log_ppl_diff": "mean",  # mean over sequences of log PPL_trainer − log PPL_sampler = −mean_t Δ (rollout_corr/log_ppl_diff)
    "log_ppl_diff_max": "max",  # its largest sequence (rollout_corr/log_ppl_diff_max)
    "log_ppl_diff_min": "min",  # its smallest sequence (rollout_corr/log_ppl_diff_min)
    "log_ppl_abs_diff": "mean",  # mean over sequences of |log PPL_trainer − log PPL_sampler| (rollout_corr/log_ppl_abs_diff)
    "ppl_ratio": "mean",  # mean over sequences of PPL_trainer / PPL_sampler (rollout_corr/ppl_ratio)
    "pearson_probs": "mean",  # Pearson correlation of the tokens' probabilities (training_rollout_actor_probs_pearson_corr)
}
MISMATCH_KEYS = tuple(MISMATCH_FIGURES)
#: |log R| of a sequence is clipped here before R² is taken (as verl does), so one long sequence
#: cannot make chi2_seq infinite
SEQUENCE_LOG_RATIO_CLIP = 20.0


def mismatch_stats(
    trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The figures of `MISMATCH_FIGURES`, in that order, as one device tensor (read once per log).

    Args:
        trainer_logps (`torch.Tensor`): the trainer's log p of each sampled token, (sequences, tokens)
            or (tokens,) for one sequence.
        sampler_logps (`torch.Tensor`): the sampler's log p of the same tokens, same shape; NaN where
            the sampler gave none (those tokens are left out).
        mask (`torch.Tensor`, *optional*): which tokens are completion tokens (default: all).

    NaN for figures without data (no tokens; a Pearson correlation of constant probabilities).
    """
    trainer_logps, sampler_logps = trainer_logps.float(), sampler_logps.float()
    if trainer_logps.dim() == 1:
        trainer_logps, sampler_logps = trainer_logps[None], sampler_logps[None]
        mask = None if mask is None else mask[None]
    mask = torch.ones_like(trainer_logps, dtype=torch.bool) if mask is None else mask.bool()
    mask = mask & ~sampler_logps.isnan() & ~trainer_logps.isnan()
    nan = torch.full((len(MISMATCH_KEYS),), float("nan"), device=trainer_logps.device)
    if not bool(mask.any()):  # the one sync here; an empty step is rare (no completion tokens)
        return nan
    delta = torch.where(mask, trainer_logps - sampler_logps, 0.0)
    d = delta[mask]
    a, ratio = d.abs(), d.exp()
    outside = ((ratio < MISMATCH_BAND[0]) | (ratio > MISMATCH_BAND[1])).float().mean()
    # per sequence (those with at least one token)
    counts = mask.sum(-1)
    has = counts > 0
    seq_sum = delta.sum(-1)[has]
    log_ppl_diff = -seq_sum / counts[has]  # log PPL_trainer − log PPL_sampler
    seq_ratio_sq = (2 * seq_sum.clamp(-SEQUENCE_LOG_RATIO_CLIP, SEQUENCE_LOG_RATIO_CLIP)).exp()
    p_s, p_t = sampler_logps[mask].exp(), trainer_logps[mask].exp()
    cs, ct = p_s - p_s.mean(), p_t - p_t.mean()
    pearson = (cs * ct).sum() / ((cs * cs).sum() * (ct * ct).sum()).sqrt()
    figures = {
        "mean_abs_dlogp": a.mean(),
        "p95_abs_dlogp": torch.quantile(a, 0.95),
        "max_abs_dlogp": a.max(),
        "outside_band_frac": outside,
        "kl": (-d).mean(),
        "k3_kl": (ratio - 1 - d).mean(),
        "chi2_token": (ratio * ratio).mean() - 1,
        "chi2_seq": seq_ratio_sq.mean() - 1,
        "log_ppl_diff": log_ppl_diff.mean(),
        "log_ppl_diff_max": log_ppl_diff.max(),
        "log_ppl_diff_min": log_ppl_diff.min(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "ppl_ratio": log_ppl_diff.exp().mean(),
        "pearson_probs": pearson,
    }
    return torch.stack([figures[k] for k in MISMATCH_KEYS])


def combine_steps(key: str, values: list[float]) -> float | None:
    """One log's value of figure `key` from its steps' values (NaN left out), as `MISMATCH_FIGURES` says."""
    finite = [v for v in values if v == v]
    if not finite:
        return None
    how = MISMATCH_FIGURES.get(key, "mean")
    return max(finite) if how == "max" else min(finite) if how == "min" else sum(finite) / len(finite)


class MismatchDrift(TrainerCallback, ExportableState):
    """The drift of a mismatch figure over training: its least-squares slope against the optimizer step,
    per 100 steps, over every step seen so far, and whether it is growing.

    In an `FP16GRPOTrainer` it is one of the trainer's callbacks (`trainer.mismatch_drift`), and its
    series travels in every checkpoint (transformers' `ExportableState`, in `trainer_state.json`), so a
    resumed run fits its slope over the whole run and warns once, as an uninterrupted one does.

    It is growing when at least `min_steps` steps are in, the slope is positive at `min_t` standard
    errors or more, the fitted line at the last step is at least `growth` times its value at the
    first (verl #7519 watched k3 KL grow 3.1x over 32 steps before a collapse), and it ends at
    `min_value` or more: a mismatch at rounding level (k3 ~1e-9 in FP32) that grows from ~0 at
    initialization, as every policy's does while it sharpens, is not a warning.

    Args:
        min_steps (`int`, defaults to 20): steps needed before it judges.
        growth (`float`, defaults to 2.0): the end/start ratio of the fitted line that counts as growth.
        min_t (`float`, defaults to 3.0): the slope's t-statistic that counts as a trend, not noise.
        min_value (`float`, defaults to 1e-5): the fitted end value below which nothing is growing (k3
            KL 1e-5 is |Δ log p| of about 0.005 per token).

    Example:
        ```python
        drift = MismatchDrift(min_steps=4)
        for step, k3 in [(0, 1e-4), (10, 2e-4), (20, 3e-4), (30, 4e-4)]:
            drift.update(step, k3)
        drift.summary()["slope_per_100_steps"]  # 1e-3
        ```
    """

    def __init__(
        self, min_steps: int = 20, growth: float = 2.0, min_t: float = 3.0, min_value: float = 1e-5
    ) -> None:
        if min_steps < 3:
            raise ValueError(f"min_steps must be >= 3 (a slope and its error), got {min_steps}.")
        if growth <= 1.0:
            raise ValueError(f"growth must be > 1 (an end/start ratio), got {growth}.")
        self.min_steps, self.growth, self.min_t, self.min_value = min_steps, growth, min_t, min_value
        self.steps: list[float] = []
        self.values: list[float] = []
        #: whether the growth warning was given (once per run, resumes included)
        self.warned = False

    def state(self) -> dict[str, Any]:
        """transformers' `ExportableState`: the settings and the series so far (plain JSON)."""
        return {
            "args": {"min_steps": self.min_steps, "growth": self.growth, "min_t": self.min_t,
                     "min_value": self.min_value},
            "attributes": {"steps": list(self.steps), "values": list(self.values), "warned": self.warned},
        }  # fmt: skip

    def restore(self, saved: dict[str, Any]) -> None:
        """Take the series of a `state()` (a checkpoint's), keeping this instance's settings."""
        attributes = saved.get("attributes", {})
        self.steps = [float(x) for x in attributes.get("steps", [])]
        self.values = [float(x) for x in attributes.get("values", [])]
        self.warned = bool(attributes.get("warned", False))

    def update(self, step: int, value: float) -> None:
        if value == value:  # NaN (a step without tokens) is left out
            self.steps.append(float(step))
            self.values.append(float(value))

    def summary(self) -> dict[str, Any] | None:
        """`slope_per_100_steps`, `stderr_per_100_steps`, `fitted_start`, `fitted_end`, `steps` and
        `growing`; None before two distinct steps."""
        n = len(self.steps)
        if n < 2:
            return None
        mx, my = sum(self.steps) / n, sum(self.values) / n
        sxx = sum((x - mx) ** 2 for x in self.steps)
        if sxx == 0:
            return None
        slope = sum((x - mx) * (y - my) for x, y in zip(self.steps, self.values)) / sxx
        intercept = my - slope * mx
        residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(self.steps, self.values))
        stderr = (residual / (n - 2) / sxx) ** 0.5 if n > 2 else float("inf")
        start, end = intercept + slope * self.steps[0], intercept + slope * self.steps[-1]
        trend = slope > 0 and (stderr == 0 or slope / stderr >= self.min_t)
        grew = (end >= self.growth * start if start > 0 else end > 0) and end >= self.min_value
        return {"slope_per_100_steps": 100 * slope, "stderr_per_100_steps": 100 * stderr, "fitted_start": start,
                "fitted_end": end, "steps": n, "growing": bool(n >= self.min_steps and trend and grew)}  # fmt: skip


class AppliedStepsOnly(TrainerCallback):
    """Wrap a callback so its `on_step_end` runs only on optimizer steps that were applied (not on
    steps the scaler skipped): for a KL or entropy controller of your own."""

    def __init__(self, inner: TrainerCallback, trainer: Any) -> None:
        self.inner, self.trainer = inner, trainer

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (a copy being built): no recursion through the lookup below
            raise AttributeError(name)
        return getattr(self.inner, name)

    def on_step_end(self, args, state, control, **kwargs):
        if not _step_skipped(self.trainer):
            return self.inner.on_step_end(args, state, control, **kwargs)
        return None


def _step_skipped(trainer: Any) -> bool:
    """Whether the optimizer step just taken was skipped (the flag the LR scheduler reads; no new sync)."""
    return trainer.loss_scaler is not None and bool(trainer.accelerator.optimizer_step_was_skipped)


def _entropy_controller_state(trainer: Any) -> tuple[float, float] | None:
    """TRL's adaptive entropy controller's state (coefficient, last measured entropy), when it runs."""
    if not getattr(trainer, "use_adaptive_entropy", False):
        return None
    return trainer.entropy_coef, trainer._last_world_entropy


class _GRPOStepCallback(TrainerCallback):
    """Per optimizer step: finish the step's mismatch figures; on a skipped step, roll back TRL's
    micro-step counter and its adaptive entropy controller, and record what did not advance; on an
    applied step, run the reference-model sync on TRL's schedule counted in applied steps (the
    scaler's counters: `FP16GRPOTrainer.applied_steps`)."""

    def __init__(self, trainer: FP16GRPOTrainer) -> None:
        self.trainer = trainer
        self._entropy_state: tuple[float, float] | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        t = self.trainer
        drift, name = t.mismatch_drift, type(t.mismatch_drift).__name__
        saved = state.stateful_callbacks.get(name)
        if state.global_step > 0 and isinstance(saved, dict) and not drift.steps:
            # resumed without `restore_callback_states_from_checkpoint` (transformers' default): the
            # drift's series comes back all the same (with it, transformers has restored it already)
            drift.restore(saved)
        # a checkpoint written before the drift was exportable has no entry: the Trainer's save needs one
        state.stateful_callbacks.setdefault(name, drift.state())
        dropout = [n for n, m in t.accelerator.unwrap_model(t.model).named_modules()
                   if isinstance(m, torch.nn.Dropout) and m.p > 0]  # fmt: skip
        if dropout and t._sampler is not None:
            warnings.warn(
                f"{len(dropout)} dropout module(s) are active (e.g. {dropout[0]!r}): the sampler runs without them and "
                "the training forward with them, so mismatch/ measures dropout too. Pass --disable_dropout true.",
                stacklevel=2,
            )
        if t.sampler_precision is not None and t.sampler_precision != trainer_precision(t):
            warnings.warn(
                f"The sampler runs in {t.sampler_precision} and the trainer in {trainer_precision(t)}: the "
                "policy that samples is not the policy that trains (expect a larger mismatch/ figures).",
                stacklevel=2,
            )

    def on_step_begin(self, args, state, control, **kwargs):
        # TRL 1.16's adaptive entropy controller (`use_adaptive_entropy`) moves its coefficient inside
        # `compute_loss` at the step boundary, before the scaler knows whether the step is skipped
        self._entropy_state = _entropy_controller_state(self.trainer)

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        t._finish_mismatch_step(state.global_step)
        lr = t.lr_scheduler.get_last_lr()[0] if t.lr_scheduler is not None else None
        skipped = _step_skipped(t)
        if skipped:
            accumulation = t.current_gradient_accumulation_steps
            # TRL's micro-step counter (private: compat.TRL_INSTANCE_INTERNALS): the retry reuses this step's slice
            t._step -= accumulation
            entropy_restored = self._entropy_state is not None
            if entropy_restored:  # the controller did not see an applied step: its update is undone
                t.entropy_coef, t._last_world_entropy = self._entropy_state
            t.loss_scale_events.write({
                "event": "grpo_skip", "step": state.global_step, "applied_steps": t.applied_steps,
                "learning_rate": lr, "scheduler_steps": getattr(t.lr_scheduler, "last_epoch", None),
                "trl_micro_step": t._step, "ref_model_synced": False, "entropy_coef_restored": entropy_restored,
                "loss_scale": t.loss_scaler.get_scale() if t.loss_scaler is not None else None,
            })  # fmt: skip
            return
        if (
            t.ref_model is not None
            and args.sync_ref_model
            and t.applied_steps % args.ref_model_sync_steps == 0  # one read of the counters per step
        ):
            model = t.accelerator.unwrap_model(kwargs["model"])
            SyncRefModelCallback.sync_target_model(model, t.ref_model, args.ref_model_mixup_alpha)


class FP16GRPOTrainer(LossScaleMixin, GRPOTrainer):
    """`trl.GRPOTrainer` under a `DynamicLossScaler` (see `LossScaleMixin`), skip-aware, measuring the
    sampler/trainer mismatch when the sampler reports its log-probabilities (`rollout_func=
    KVCacheSampler(...)`, or vLLM): see the module docstring. FP32 and BF16 runs measure it too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        rollout = kwargs.get("rollout_func")
        #: the sampler when it is ours (a `KVCacheSampler`: its precision is known), else None
        self._sampler = rollout if isinstance(rollout, KVCacheSampler) else None
        #: this optimizer step's micro-batches: (trainer log p, sampler log p, completion mask)
        self._mismatch_batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._mismatch_pending: list[tuple[int, torch.Tensor]] = []
        super().__init__(*args, **kwargs)
        self.pop_callback(SyncRefModelCallback)  # replaced: the sync counts applied steps
        # The overflow diagnosis replays a step's raw batches through `compute_loss`; GRPO's batches are
        # prompts that become inputs only through generation, so the replay cannot run: skips are still
        # counted, logged and backed off, without the per-module origin.
        self.pop_callback(OverflowDiagnosisCallback)
        # first, so that every other callback's on_step_end sees the step's bookkeeping done
        self.callback_handler.callbacks.insert(0, _GRPOStepCallback(self))
        # the drift of k3 KL over the run (`mismatch/k3_kl_drift_per_100_steps`), warned about once: a
        # callback so that its series travels in checkpoints (`ExportableState`)
        self.add_callback(MismatchDrift())

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        _refuse_dropped_fsdp(self.args, self.accelerator)

    @property
    def applied_steps(self) -> int:
        """Optimizer steps applied so far (not skipped), from the scaler's counters (`total_steps -
        skipped_steps` of `stats()`, restored with it on resume: one read of the device); without a
        scaler nothing is skipped, and it is `state.global_step`."""
        if self.loss_scaler is None:
            return self.state.global_step
        stats = self.loss_scaler.stats()
        return stats["total_steps"] - stats["skipped_steps"]

    @property
    def mismatch_drift(self) -> MismatchDrift:
        """The k3 KL drift over the run: the `MismatchDrift` among the callbacks (transformers replaces
        it by a restored copy on resume with `restore_callback_states_from_checkpoint`)."""
        return next(cb for cb in self.callback_handler.callbacks if isinstance(cb, MismatchDrift))

    @property
    def sampler_precision(self) -> str | None:
        return self._sampler.resolved(self) if self._sampler is not None else None

    def loss_scale_run_info(self) -> dict[str, Any]:
        """Added to `run_start`: both precisions, so a reader sees whether they differ."""
        sampler = self._sampler
        return {"rl": {"sampler_precision": self.sampler_precision, "trainer_precision": trainer_precision(self),
                       "sampler": type(sampler).__name__ if sampler else None,
                       "sampler_attn_implementation": sampler.attn_implementation if sampler else None}}  # fmt: skip

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        sampled = inputs.get("sampling_per_token_logps") if self.model.training else None
        if sampled is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        captured: list[torch.Tensor] = []

        def keep_scores(module, args, output):  # TRL's fused LM head: log p of each label, as trained on
            scores = getattr(output, "log_probs", None)
            if scores is not None and not captured:
                captured.append(scores.detach())

        handle = self.accelerator.unwrap_model(model).register_forward_hook(keep_scores)
        try:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            handle.remove()
        if captured:
            completion_ids, mask = inputs["completion_ids"], inputs["completion_mask"].bool()
            trainer_logps = captured[0][:, -completion_ids.shape[1] :].float()  # temperature applied by TRL
            self._mismatch_batches.append((trainer_logps, sampled.float(), mask))
        return loss

    def _finish_mismatch_step(self, step: int) -> None:
        if self._mismatch_batches:
            width = max(t.shape[1] for t, _, _ in self._mismatch_batches)
            pad = lambda x, v: torch.nn.functional.pad(x, (0, width - x.shape[1]), value=v)  # noqa: E731
            trainer_logps, sampler_logps, mask = (
                torch.cat([pad(b[i], v) for b in self._mismatch_batches])
                for i, v in ((0, 0.0), (1, 0.0), (2, False))
            )
            if self.accelerator.num_processes > 1:
                # every rank's completions (TRL splits the batch across ranks): the figures describe the
                # step's whole batch and read the same on every rank, not rank 0's share
                acc = self.accelerator
                trainer_logps, sampler_logps, mask = (
                    acc.gather(acc.pad_across_processes(x, dim=1, pad_index=0))
                    for x in (trainer_logps, sampler_logps, mask.to(torch.uint8))
                )
                mask = mask.bool()
            self._mismatch_pending.append((step, mismatch_stats(trainer_logps, sampler_logps, mask)))
            self._mismatch_batches = []

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self._mismatch_pending and "loss" in logs:
            steps = [s for s, _ in self._mismatch_pending]
            values = torch.stack([v for _, v in self._mismatch_pending]).tolist()  # one read per log
            self._mismatch_pending = []
            for step, row in zip(steps, values):
                self.loss_scale_events.write(
                    {"event": "mismatch", "step": step, **dict(zip(MISMATCH_KEYS, row))}
                )
            for key, column in zip(MISMATCH_KEYS, zip(*values)):
                value = combine_steps(key, list(column))
                if value is not None:
                    logs[f"mismatch/{key}"] = value
            k3, drift = MISMATCH_KEYS.index("k3_kl"), self.mismatch_drift
            for step, row in zip(steps, values):
                drift.update(step, row[k3])
            self._report_drift(logs)
            logs["applied_steps"] = self.applied_steps
        super().log(logs, *args, **kwargs)

    def _report_drift(self, logs: dict[str, float]) -> None:
        series = self.mismatch_drift
        drift = series.summary()
        if drift is None:
            return
        logs["mismatch/k3_kl_drift_per_100_steps"] = drift["slope_per_100_steps"]
        if drift["growing"] and not series.warned:
            series.warned = True
            self.loss_scale_events.write({"event": "mismatch_drift", "figure": "k3_kl", **drift})
            warnings.warn(
                f"The sampler/trainer mismatch is growing: k3 KL rose from {drift['fitted_start']:.3g} to "
                f"{drift['fitted_end']:.3g} over {drift['steps']} steps ({drift['slope_per_100_steps']:.3g} per "
                "100 steps). A growing mismatch preceded the collapses verl #7519 reports: check the sampler's "
                "precision, or correct for it (TRL's importance sampling).",
                stacklevel=2,
            )


def _refuse_dropped_fsdp(args: Any, accelerator: Any) -> None:
    """FSDP asked for (`fsdp=True`, `fsdp_config`) but not running: Accelerate applies its FSDP plugin
    only on accelerator devices (`AcceleratorState`: the FSDP switch sits under the GPU-type
    distributed types), so on the CPU with several gloo ranks it drops the plugin and wraps the model
    in DDP instead, without a word. The GRPO run would then be a DDP run that the user believes is
    sharded: refused, with the two ways that work."""
    if (
        getattr(args, "fsdp_plugin_args", None) is None
        or accelerator.distributed_type == DistributedType.FSDP
    ):
        return
    raise ValueError(
        f"fsdp={args.fsdp!r} (fsdp_config version {args.fsdp_plugin_args.get('fsdp_version')}) was asked for, but "
        f"Accelerate runs this as {accelerator.distributed_type.value} on {accelerator.device.type}: it applies "
        "FSDP only on accelerator devices (CUDA, XPU, NPU, ...), and on the CPU drops the plugin and wraps the "
        "model in DDP. Drop fsdp on the CPU (DDP all-reduces the gradients, so every rank skips the same "
        "steps), or run FSDP2 on GPUs, where FP16GRPOTrainer stays skip-aware (docs/rl.md)."
    )


def async_grpo_available() -> bool:
    """Whether the installed TRL ships `trl.experimental.async_grpo.AsyncGRPOTrainer` (TRL 1.16 does)."""
    import importlib.util

    try:
        return importlib.util.find_spec("trl.experimental.async_grpo") is not None
    except ModuleNotFoundError:
        return False


class FP16AsyncGRPOTrainer:
    """Refused: TRL's `AsyncGRPOTrainer` under a loss scaler is not supported (yet).

    TRL 1.16 ships it (`trl.experimental.async_grpo`), but it does not fit what makes `FP16GRPOTrainer`
    hold: its rollouts come from a vLLM server that a callback feeds new weights every
    `weight_sync_steps` optimizer steps (a skipped step would push unchanged weights and bump the
    model version that its staleness accounting counts), and its loss runs on packed "tree" batches
    with the server's `old_log_probs`, not on TRL's GRPO batches where the mismatch is read. Making it
    skip-aware needs the weight push and version bump gated on applied steps and the mismatch read
    from `old_log_probs`; neither can be tested without a vLLM server. Use `FP16GRPOTrainer` (with
    `use_vllm=True` for a vLLM sampler), or TRL's AsyncGRPO in BF16/FP32 (its default is FP32, TRL #6774).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        shipped = "ships it (trl.experimental.async_grpo)" if async_grpo_available() else "does not ship it"
        raise NotImplementedError(
            f"AsyncGRPO under a loss scaler is not supported: the installed TRL {shipped}, but "
            f"{ASYNC_GRPO_REFUSAL}."
        )
