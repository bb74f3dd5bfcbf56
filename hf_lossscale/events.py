"""The per-run JSONL event log that `LossScaleEventLogCallback` writes (`loss_scale_log.jsonl` in `output_dir`).

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

__all__ = ["EVENT_LOG_NAME", "read_events", "read_new_events", "read_run_events", "train_log_series"]

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


def read_new_events(path: str | os.PathLike, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The complete events written after byte `offset`, and the offset to read from next time
    (for following a running job's log without re-reading it)."""
    if not os.path.exists(path):
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1  # a half-written last line waits for the next call
    lines = data[:end].decode("utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()], offset + end


def train_log_series(events: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """From the training-loss log events: `steps`, `losses`, `scales` (None when not FP16) and
    `skipped_at`, the steps at which the cumulative skip count rose."""
    out: dict[str, list[Any]] = {"steps": [], "losses": [], "scales": [], "skipped_at": []}
    last_skipped = 0
    for e in events:
        if e.get("event") != "log" or "loss" not in e or "eval_loss" in e:
            continue
        out["steps"].append(int(e["step"]))
        out["losses"].append(float(e["loss"]))
        out["scales"].append(e.get("loss_scale"))
        skipped = int(e.get("skipped_steps", 0))
        if skipped > last_skipped:
            out["skipped_at"].append(int(e["step"]))
        last_skipped = skipped
    return out


def read_run_events(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The events of the latest run: from its last fresh (not resumed) `run_start` on, resumes included.

    Returns an empty list when the file does not exist (the run never started training).
    """
    if not os.path.exists(path):
        return []
    events = read_events(path)
    starts = [i for i, e in enumerate(events) if e.get("event") == "run_start" and not e.get("resumed")]
    return events[starts[-1] :] if starts else events
