"""Reading a run's event files back: JSON lines, one event a line, as written by
``elastictrain.core.log`` (where they live: ``elastictrain.runlog.events``). A torn line (its
writer killed mid-line) is skipped."""

from __future__ import annotations

import json
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastictrain.storage.api import Store


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Parse a JSON-lines event file, skipping a torn last line (a killed writer)."""
    return parse_event_lines(Path(path).read_text(encoding="utf-8"))


def parse_event_lines(text: str) -> list[dict[str, Any]]:
    """Parse JSON-lines events, skipping torn lines."""
    events: list[dict[str, Any]] = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def read_event_files(location: str | Path, pattern: str = "*.jsonl",
                     store: Store | None = None) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """``(file name, events)`` for each event file directly in ``location``, sorted by
    name: a local directory, or (with ``store`` opened at that URL) an object prefix."""
    if store is None:
        for path in sorted(Path(location).glob(pattern)):
            yield path.name, parse_event_lines(path.read_text(encoding="utf-8"))
        return
    for name in sorted(store.list_dir("")):
        if fnmatch(name, pattern):
            yield name, parse_event_lines(store.read_bytes(name).decode("utf-8"))
