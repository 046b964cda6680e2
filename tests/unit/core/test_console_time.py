"""Events rendered for a reader (``elastictrain run --no-view``, a terminal) start with
the clock time, not ``ts=<epoch seconds>``; the event file keeps epoch seconds."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import structlog

from elastictrain.core import log as et_log


def test_console_lines_start_with_the_time_and_files_keep_epoch(tmp_path: Path) -> None:
    stream = io.StringIO()
    events = tmp_path / "events.jsonl"
    et_log.configure("info", json_output=False, stream=stream, events_file=events)
    try:
        et_log.get_logger("elastictrain.test").info("agent.start", nnodes="2:2")
    finally:
        et_log.configure("info", stream=io.StringIO())
        structlog.reset_defaults()
    line = stream.getvalue().splitlines()[0]
    assert re.match(r"^\d\d:\d\d:\d\d\.\d{3} \[info\s*\] agent\.start\s+nnodes=2:2$", line), line
    assert "ts=" not in line
    (written,) = [json.loads(x) for x in events.read_text().splitlines()]
    assert isinstance(written["ts"], float) and written["event"] == "agent.start"
