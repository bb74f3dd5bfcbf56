"""The per-run JSONL event log that `LossScaleEventLogCallback` writes (`loss_scale_log.jsonl` in `output_dir`).

One JSON object per line, with an `event` key: `run_start` (versions, precision, loss-scale config),
`log` (every Trainer log: loss, eval metrics; training logs add `loss_scale`, `skipped_steps`, ...),
`telemetry` (`step`: the optimizer step it was measured at; `log_step`: the log that read it), `flushed_probe`
(`measure_flushed_fraction` at the start / end of training), `error` (the exception that stopped
the run; `collapse` is true for a `LossScaleCollapseError`), `run_end` (the scaler's final stats).
A resumed run appends to the same file. Importing this module needs no torch.

In a run, every event passes through one `EventSink`: the scaler's observers queue theirs in one
(`ScalerObserver.drain_events`), the Trainer's callbacks emit into the event log's, and whoever
wants them (the JSONL file, TensorBoard, a test) subscribes to it or reads it.

Strict JSON: every line parses with a strict parser (`json.loads(..., parse_constant=...)` raising,
JavaScript's `JSON.parse`, jq). A number that is not finite -- `headroom_bits` of a snapshot that
held inf/NaN (-inf) or only zeros (+inf), a NaN loss, an infinite `grad_norm` -- is written as
`null` (`strict_json`), never as `NaN` / `Infinity`; a null figure means "not finite".
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any

__all__ = [
    "EVENT_LOG_NAME",
    "EventSink",
    "REQUIRED",
    "append_event",
    "read_events",
    "read_events_counted",
    "read_new_events",
    "read_run_events",
    "strict_json",
    "train_log_series",
]

EVENT_LOG_NAME = "loss_scale_log.jsonl"


class EventSink:
    """Where a run's events go: one ordered record, written by observers and callbacks, read by anyone.

    `emit(event)` records an event (a dict with an `event` kind) and hands it to each subscriber in
    order (the event log's file, TensorBoard); `of(*kinds)` reads the recorded events of those kinds;
    `drain()` takes those recorded since the last drain. An event emitted with `keep=False` (a
    Trainer log line, a telemetry histogram: the file and the Trainer's own history hold those) goes
    to the subscribers only, so a long run's sink holds just the rare events.

    Example:

    ```python
    >>> sink = EventSink()
    >>> seen = []
    >>> sink.subscribe(seen.append)
    >>> sink.emit({"event": "floor", "steps_at_floor": 3})
    >>> sink.emit({"event": "log", "step": 1, "loss": 0.5}, keep=False)
    >>> [e["event"] for e in seen], [e["event"] for e in sink.events]
    (['floor', 'log'], ['floor'])
    >>> [e["event"] for e in sink.drain()], sink.drain()
    (['floor'], [])
    ```
    """

    def __init__(self) -> None:
        #: The recorded events, in the order they were emitted.
        self.events: list[dict[str, Any]] = []
        self._subscribers: list[Callable[[dict[str, Any]], None]] = []
        self._drained = 0  # events[:_drained] were taken by drain()

    def subscribe(self, receive: Callable[[dict[str, Any]], None]) -> None:
        """Hand every event emitted from now on to `receive(event)`."""
        self._subscribers.append(receive)

    def emit(self, event: dict[str, Any], *, keep: bool = True) -> None:
        """Record `event` (unless `keep=False`) and hand it to the subscribers."""
        if keep:
            self.events.append(event)
        for receive in list(self._subscribers):
            receive(event)

    def of(self, *kinds: str) -> list[dict[str, Any]]:
        """The recorded events whose `event` is one of `kinds`, in order."""
        return [e for e in self.events if e.get("event") in kinds]

    def drain(self) -> list[dict[str, Any]]:
        """The events recorded since the last call."""
        out = self.events[self._drained :]
        self._drained = len(self.events)
        return out


#: Fields each kind of event must carry for the readers (`report`, `compare`) to use it; an event
#: without them is skipped and counted, as an unreadable line is.
REQUIRED: dict[str, tuple[str, ...]] = {
    "log": ("step",),
    "telemetry": ("step", "counts"),
    "overflow": ("step", "modules", "n_params", "loss_scale_after"),
    "flushed_probe": ("when", "step", "scale", "overflow"),
    "error": ("type", "step", "message"),
}


def _parse(raw: bytes) -> dict[str, Any] | None:
    """One line as an event, or None when it is not one (not UTF-8, not JSON, not an object with an
    `event`, or missing what its kind requires)."""
    try:
        event = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        return None
    if any(key not in event for key in REQUIRED.get(event["event"], ())):
        return None
    return event


def _complete_lines(data: bytes) -> list[bytes]:
    """The lines that end with a newline (a half-written last line, being written or cut by a crash,
    is left for later)."""
    return data[: data.rfind(b"\n") + 1].split(b"\n")[:-1]


def read_events_counted(path: str | os.PathLike) -> tuple[list[dict[str, Any]], int]:
    """Every complete, readable event in the file, and how many lines were skipped: blank, binary, not
    JSON, not an object, or an event missing its kind's fields (`REQUIRED`); a crash mid-write and a
    resumed run appending can leave such lines."""
    with open(path, "rb") as f:
        lines = _complete_lines(f.read())
    events = [e for e in map(_parse, lines) if e is not None]
    return events, len(lines) - len(events)


def read_events(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete, readable event in the file (see `read_events_counted`, which also counts the
    lines it skips)."""
    return read_events_counted(path)[0]


def read_new_events(path: str | os.PathLike, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The complete events written after byte `offset`, and the offset to read from next time
    (for following a running job's log without re-reading it); unreadable lines are skipped."""
    if not os.path.exists(path):
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1  # a half-written last line waits for the next call
    return [e for e in map(_parse, _complete_lines(data)) if e is not None], offset + end


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float (NaN, +-inf), at any depth of dicts, lists and tuples,
    replaced by None: what `json.dumps(..., allow_nan=False)` accepts and writes as `null`. Other
    values are returned as they are (the same object when nothing changed)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def append_event(path: str | os.PathLike, event: dict[str, Any]) -> None:
    """Append one JSON line; when the file does not end with a newline (a crash cut its last line), the
    event starts a fresh line, so the cut line stays one unreadable line and the new one reads."""
    with open(path, "ab+") as f:
        f.seek(0, os.SEEK_END)
        prefix = b""
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            prefix = b"" if f.read(1) == b"\n" else b"\n"
        f.write(prefix + (json.dumps(strict_json(event), allow_nan=False) + "\n").encode("utf-8"))


def train_log_series(events: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """From the training-loss log events: `steps`, `losses`, `scales` (None when not FP16) and
    `skipped_at`, the steps at which the cumulative skip count rose."""
    out: dict[str, list[Any]] = {"steps": [], "losses": [], "scales": [], "skipped_at": []}
    last_skipped = 0
    for e in events:
        if e.get("event") != "log" or "loss" not in e or "eval_loss" in e:
            continue
        try:
            step, loss = int(e["step"]), float(e["loss"])
        except (TypeError, ValueError):
            continue  # a malformed number: skipped like an unreadable line
        out["steps"].append(step)
        out["losses"].append(loss)
        out["scales"].append(e.get("loss_scale"))
        skipped = int(e.get("skipped_steps", 0))
        if skipped > last_skipped:
            out["skipped_at"].append(int(e["step"]))
        last_skipped = skipped
    return out


def read_run_events(path: str | os.PathLike, skipped: list[int] | None = None) -> list[dict[str, Any]]:
    """The events of the latest run: from its last fresh (not resumed) `run_start` on, resumes included.

    Returns an empty list when the file does not exist (the run never started training). `skipped`,
    if given, gets the number of unreadable lines appended.
    """
    if not os.path.exists(path):
        return []
    events, bad = read_events_counted(path)
    if skipped is not None:
        skipped.append(bad)
    starts = [i for i, e in enumerate(events) if e.get("event") == "run_start" and not e.get("resumed")]
    return events[starts[-1] :] if starts else events
