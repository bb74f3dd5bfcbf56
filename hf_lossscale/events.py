"""The per-run JSONL event log that `LossScaleMixin` writes (`loss_scale_log.jsonl` in `output_dir`).

One JSON object per line, with an `event` key: `run_start` (versions, precision, loss-scale config),
`log` (every Trainer log: loss, eval metrics, `loss_scale`, `skipped_steps`, ...), `flushed_probe`
(`measure_flushed_fraction` at the start / end of training), `error` (the exception that stopped
the run; `collapse` is true for a `LossScaleCollapseError`), `run_end` (the scaler's final stats).
A resumed run appends to the same file. Importing this module needs no torch.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["EVENT_LOG_NAME", "read_events", "read_run_events"]

EVENT_LOG_NAME = "loss_scale_log.jsonl"


def read_events(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete event in the file (a half-written last line, from a killed run, is dropped)."""
    events = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.endswith("\n"):
                break  # being written, or cut by a crash
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{os.fspath(path)} line {number} is not JSON: {err}") from None
    return events


def read_run_events(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The events of the latest run: from its last fresh (not resumed) `run_start` on, resumes included.

    Returns an empty list when the file does not exist (the run never started training).
    """
    if not os.path.exists(path):
        return []
    events = read_events(path)
    starts = [i for i, e in enumerate(events) if e.get("event") == "run_start" and not e.get("resumed")]
    return events[starts[-1] :] if starts else events
