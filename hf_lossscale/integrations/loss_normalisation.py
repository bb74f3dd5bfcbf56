"""Gradient accumulation must not multiply the gradients (and with them what FP16 sees).

The Trainer skips its division by `gradient_accumulation_steps` for a model whose `forward` takes
`**kwargs`, trusting it to divide by `num_items_in_batch` itself. Some models take `**kwargs` and
compute a plain mean loss (transformers 5.24's `BertForMaskedLM`): their gradients and logged loss
then come out `gradient_accumulation_steps` times too large. `fix_loss_normalisation` finds such a
model (looked at as the Trainer does: unwrapped from Accelerate and PEFT) and tells the Trainer, which
then divides each micro-batch's loss as before 4.46.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

__all__ = ["fix_loss_normalisation", "loss_ignores_num_items"]

logger = logging.getLogger(__name__)


def loss_ignores_num_items(model: torch.nn.Module) -> bool:
    """Whether `type(model).forward` computes a loss without `num_items_in_batch` (read from its
    source: it names neither `num_items_in_batch` nor `self.loss_function`, which takes it). False
    when the source cannot be read; a wrong True only restores the Trainer's per-micro-batch mean."""
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
    return "num_items_in_batch" not in source and "loss_function" not in source


def fix_loss_normalisation(trainer: Any) -> dict[str, Any] | None:
    """Set `trainer.model_accepts_loss_kwargs = False` where the model would otherwise get the sum of
    its micro-batch losses; return the `loss_normalisation` event (None when nothing was done).

    Nothing is done without gradient accumulation, with `loss_scale_fix_accumulated_loss=False`,
    with a `compute_loss_func`, a `compute_loss` override or `loss_is_scaled_for_ga` (the user
    decided), or for a model that declares `accepts_loss_kwargs` or names `num_items_in_batch`.
    When it acts it says so in the run's log (a warning) and the event log.
    """
    from transformers import Trainer
    from transformers.trainer_utils import unwrap_peft_model

    args = trainer.args
    if (
        not getattr(trainer, "model_accepts_loss_kwargs", False)
        or args.gradient_accumulation_steps == 1
        or not getattr(args, "loss_scale_fix_accumulated_loss", True)
    ):
        return None
    if (
        getattr(trainer, "compute_loss_func", None) is not None
        or getattr(trainer, "loss_is_scaled_for_ga", None) is not None
    ):
        return None  # the user decided how the loss is normalised
    if type(trainer).compute_loss is not Trainer.compute_loss:
        return None  # a subclass computes its own loss and may use num_items_in_batch
    model = unwrap_peft_model(trainer.accelerator.unwrap_model(trainer.model))
    if getattr(model, "accepts_loss_kwargs", None) is not None or not loss_ignores_num_items(model):
        return None
    trainer.model_accepts_loss_kwargs = False
    steps = args.gradient_accumulation_steps
    logger.warning(
        "%s.forward takes **kwargs but computes its loss without num_items_in_batch: the Trainer would "
        "sum the %d micro-batch losses of each step instead of averaging them (gradients and logged loss "
        "x%d). Dividing each micro-batch's loss by gradient_accumulation_steps instead "
        "(trainer.model_accepts_loss_kwargs = False; --loss_scale_fix_accumulated_loss false turns this off).",
        type(model).__name__, steps, steps,
    )  # fmt: skip
    return {
        "event": "loss_normalisation",
        "model": type(model).__name__,
        "gradient_accumulation_steps": steps,
        "action": "model_accepts_loss_kwargs = False: each micro-batch's loss is divided by "
        "gradient_accumulation_steps",
    }
