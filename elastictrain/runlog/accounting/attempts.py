"""A run's attempts from its events directory: one per worker process lifetime.

Rank 0's event files (``attempt*-rank0.jsonl``) are read and cut at every
``worker.start``, so an attempt is found the same way whether a torchrun restart
wrote a new file or a relaunch appended to an old one. Files that cannot be read
are skipped (an accounting never fails a run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastictrain.runlog.events_read import read_events

Event = dict[str, Any]


def read_attempts(events_dir: str | Path) -> list[list[Event]]:
    """Rank 0's attempts, each a time-ordered list of events, oldest attempt first."""
    attempts: list[list[Event]] = []
    for path in _files(Path(events_dir), "attempt*-rank0.jsonl"):
        current: list[Event] = []
        for event in _read(path):
            if event.get("event") == "worker.start" and current:
                attempts.append(current)
                current = []
            current.append(event)
        if current:
            attempts.append(current)
    return sorted(attempts, key=lambda events: events[0]["ts"])


def read_agent_events(events_dir: str | Path) -> list[Event]:
    """The launcher agents' events (``agent-*.jsonl``), time-ordered."""
    events = [e for path in _files(Path(events_dir), "agent*.jsonl") for e in _read(path)]
    return sorted(events, key=lambda e: e["ts"])


def _files(directory: Path, pattern: str) -> list[Path]:
    try:
        return sorted(directory.glob(pattern))
    except OSError:
        return []


def _read(path: Path) -> list[Event]:
    try:
        events = read_events(path)
    except (OSError, ValueError):
        return []
    return sorted((e for e in events if isinstance(e.get("ts"), (int, float))),
                  key=lambda e: e["ts"])
