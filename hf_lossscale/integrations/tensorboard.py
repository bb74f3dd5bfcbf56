"""Gradient exponent histograms in TensorBoard, beside the scalars the Trainer already sends there.

With `report_to` including `"tensorboard"`, `LossScaleMixin` adds `LossScaleTensorBoardCallback`: for
each telemetry snapshot a log step read (`loss_scale_telemetry_interval`; the activation probe
with `loss_scale_activation_probe`) it writes histograms of `log2|g|`, on the FP16 number line
(`-24` is FP16's smallest subnormal, `-14` its smallest normal, `16` overflows), through the writer of
transformers' `TensorBoardCallback`, so they land in the same event file as `train/loss_scale`:

- `loss_scale/grad_log2`: every parameter gradient as the scaler saw it (scaled), and
  `loss_scale/grad_log2/<module>` per module;
- `loss_scale/act_grad_log2` (and per module): the sampled FP16 activation gradients.

Parameter-gradient histograms sit at the optimizer step the snapshot was measured at (the event
log's `step`, the logs' `grad_telemetry_step`), which can be before the log step that read it.

Zeros and inf/NaN have no place on a log axis: they are the `grad_zero_frac` / `overflow_rate`
scalars. Values below 2^-24 (flushed in FP16) are counted in the bin `[-25, -24)`, values at or above
2^16 in `[16, 17)`.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from ..core.events import EventSink
from ..core.telemetry import BUCKETS, MIN_EXP

__all__ = ["LossScaleTensorBoardCallback", "log2_histogram"]

logger = logging.getLogger(__name__)

#: Right edges of the finite, nonzero buckets (`<2^-24`, `2^-24` .. `2^15`, `>=2^16`) in log2 units.
LIMITS = [float(e) for e in range(MIN_EXP, MIN_EXP + len(BUCKETS) - 2)]


def log2_histogram(counts: list[int]) -> dict[str, Any] | None:
    """`SummaryWriter.add_histogram_raw` arguments for a `telemetry.BUCKETS` histogram, over log2|g|
    (each value at its bin's centre); None when it has no finite nonzero value."""
    finite = [int(c) for c in counts[1:-1]]  # drop `zero` and `inf/nan`
    num = sum(finite)
    if num == 0:
        return None
    centres = [limit - 0.5 for limit in LIMITS]
    used = [i for i, c in enumerate(finite) if c]
    return {
        "min": LIMITS[used[0]] - 1.0,
        "max": LIMITS[used[-1]],
        "num": num,
        "sum": sum(c * x for c, x in zip(finite, centres)),
        "sum_squares": sum(c * x * x for c, x in zip(finite, centres)),
        "bucket_limits": LIMITS,
        "bucket_counts": finite,
    }


class LossScaleTensorBoardCallback(TrainerCallback):
    """Writes the run's `telemetry` events (the snapshots a training log read, which
    `LossScaleMixin.log` emits into the event sink) as TensorBoard histograms. Add it after
    transformers' `TensorBoardCallback` (the mixin does): it writes with that callback's `tb_writer`,
    on the main process only.

    Args:
        trainer: the `Trainer` whose writer it uses.
        sink (`EventSink`): the run's event sink (`trainer.loss_scale_events.sink`).
    """

    TAGS = {"param_grads": "loss_scale/grad_log2", "activation_grads": "loss_scale/act_grad_log2"}

    def __init__(self, trainer: Any, sink: EventSink) -> None:
        self.trainer = trainer
        self._warned = False
        sink.subscribe(self._receive)

    def _writer(self) -> Any:
        from transformers.integrations import TensorBoardCallback

        for callback in self.trainer.callback_handler.callbacks:
            if isinstance(callback, TensorBoardCallback) and callback.tb_writer is not None:
                return callback.tb_writer
        return None

    def _receive(self, event: dict[str, Any]) -> None:
        if event.get("event") != "telemetry" or not self.trainer.is_world_process_zero():
            return
        writer = self._writer()
        if writer is None:
            if not self._warned:
                logger.warning(
                    "No TensorBoard writer (report_to has no 'tensorboard'?): gradient histograms not written."
                )
                self._warned = True
            return
        tag = self.TAGS[event["source"]]
        # the step the snapshot was measured at (the event's `step`), not the log's
        figures = {tag: event["counts"]}
        figures.update({f"{tag}/{module}": s["counts"] for module, s in event.get("per_module", {}).items()})
        for name, counts in figures.items():
            histogram = log2_histogram(counts)
            if histogram is not None:
                writer.add_histogram_raw(name, global_step=event["step"], **histogram)
        writer.flush()
