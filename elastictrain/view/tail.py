"""Follow a run's JSON-lines event files incrementally, on any Store.

Event files are appended by several processes (the agent, every worker, the
persister through its worker); a reader can see a line before its newline.
Only complete lines are consumed: a partial last line waits for the next poll.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from elastictrain.storage.api import Store

# Folders under an events directory that hold no event files of ours (torchrun's
# per-worker logs, the multi-node demo's gate files) and can be large.
_SKIP_DIRS = frozenset({"torchelastic", "gates"})
_MAX_DEPTH = 3


@dataclass
class EventTail:
    """Reads the events appended since the last :meth:`poll` under ``root`` of ``store``.

    Args:
        store: where the run's events are (local directory, S3, …).
        root: the events directory, relative to the store's root ("" for the root).
    """

    store: Store
    root: str = ""
    _offsets: dict[str, int] = field(default_factory=dict)

    def poll(self) -> list[dict[str, Any]]:
        """New complete events of every file, in time order."""
        return [event for _, event in self.poll_with_paths()]

    def poll_with_paths(self) -> list[tuple[str, dict[str, Any]]]:
        """New complete events of every file with the file's path, in time order."""
        found: list[tuple[str, dict[str, Any]]] = []
        for path in self._event_files(self.root, 0):
            found += [(path, event) for event in self._read_new(path)]
        found.sort(key=lambda item: float(item[1].get("ts") or 0.0))
        return found

    def _event_files(self, directory: str, depth: int) -> list[str]:
        files: list[str] = []
        for name in self.store.list_dir(directory):
            path = f"{directory}/{name}" if directory else name
            if name.endswith(".jsonl"):
                files.append(path)
            elif "." not in name and name not in _SKIP_DIRS and depth < _MAX_DEPTH:
                files += self._event_files(path, depth + 1)  # a file here lists as []
        return files

    def _read_new(self, path: str) -> list[dict[str, Any]]:
        offset = self._offsets.get(path, 0)
        data = _read_from(self.store, path, offset)
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self._offsets[path] = offset + end + 1
        events = []
        for line in data[:end].splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a killed writer, followed by the next one
            if isinstance(event, dict):
                events.append(event)
        return events


def _read_from(store: Store, path: str, offset: int) -> bytes:
    """Bytes of ``path`` from ``offset``: a seek on local files, a whole read elsewhere."""
    local = store.local_path(path)
    if local is not None:
        try:
            with open(local, "rb") as fh:
                fh.seek(offset)
                return fh.read()
        except FileNotFoundError:
            return b""
    return store.read_bytes(path)[offset:]
