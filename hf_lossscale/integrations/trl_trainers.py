"""TRL's trainers with loss scaling you configure: FP16 SFT, DPO and GRPO fine-tuning.

FP16 is coming back for RL fine-tuning of LLMs (Qi et al., "Defeating the Training-Inference Mismatch
via FP16", arXiv 2510.26788): its 10 mantissa bits make the trained policy match the sampling
engine's far better than BF16's 7, and FP16 needs loss scaling. TRL's trainers subclass `Trainer`,
so `LossScaleMixin` puts them under a `DynamicLossScaler`; the `FP16*Config` classes are TRL's
configs with the `LossScaleTrainingArguments` flags (`loss_scale_mode`, `loss_scale_init`, ...):

```python
from hf_lossscale.integrations.trl_trainers import FP16SFTConfig, FP16SFTTrainer

args = FP16SFTConfig(output_dir="out", fp16=True, loss_scale_growth_interval=500)
trainer = FP16SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
trainer.train()
```

GRPO: `FP16GRPOTrainer` is skip-aware and measures the sampler/trainer mismatch with a
`KVCacheSampler` as its `rollout_func` (`hf_lossscale.integrations.grpo`).

Needs `pip install "hf_lossscale[trl]"`; tested against the TRL release in `compat.TESTED_VERSIONS`.
"""

from __future__ import annotations

from dataclasses import dataclass

from trl import DPOConfig, DPOTrainer, GRPOConfig, SFTConfig, SFTTrainer

from .compat import warn_if_untested
from .grpo import FP16GRPOTrainer, KVCacheSampler
from .trainer import LossScaleMixin
from .training_args import LossScaleTrainingArguments

__all__ = [
    "FP16SFTConfig",
    "FP16SFTTrainer",
    "FP16DPOConfig",
    "FP16DPOTrainer",
    "FP16GRPOConfig",
    "FP16GRPOTrainer",
    "KVCacheSampler",
]

warn_if_untested()


@dataclass
class FP16SFTConfig(LossScaleTrainingArguments, SFTConfig):
    """`trl.SFTConfig` with the loss-scale flags of `LossScaleTrainingArguments`."""


@dataclass
class FP16DPOConfig(LossScaleTrainingArguments, DPOConfig):
    """`trl.DPOConfig` with the loss-scale flags of `LossScaleTrainingArguments`."""


@dataclass
class FP16GRPOConfig(LossScaleTrainingArguments, GRPOConfig):
    """`trl.GRPOConfig` with the loss-scale flags of `LossScaleTrainingArguments`."""


class FP16SFTTrainer(LossScaleMixin, SFTTrainer):
    """`trl.SFTTrainer` under a `DynamicLossScaler` (see `LossScaleMixin`)."""


class FP16DPOTrainer(LossScaleMixin, DPOTrainer):
    """`trl.DPOTrainer` under a `DynamicLossScaler` (see `LossScaleMixin`)."""
