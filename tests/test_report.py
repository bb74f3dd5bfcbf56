"""`hf-lossscale report` on event logs that hold what the strict-JSON event log writes."""

import json

from test_telemetry import run_trainer


def test_report_reads_a_null_headroom(tmp_path):
    """The event log writes a non-finite headroom_bits (a snapshot holding inf/NaN) as null (strict
    JSON, issue 48); the report prints it as not finite instead of failing on it."""
    from hf_lossscale.tools.cli import main

    run_trainer(tmp_path)
    log = tmp_path / "out" / "loss_scale_log.jsonl"
    events = [json.loads(line) for line in log.read_text().splitlines()]
    last = max(i for i, e in enumerate(events) if e.get("source") == "param_grads")
    events[last]["headroom_bits"] = None
    events[last]["per_module"]["classifier"]["headroom_bits"] = None
    log.write_text("".join(json.dumps(e, allow_nan=False) + "\n" for e in events))
    assert main(["report", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "report" / "report.md").read_text()
    assert "headroom n/a (not finite) bits" in text and "| classifier |" in text
