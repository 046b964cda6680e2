"""The workers' own output in the live view of ``elastictrain run``.

While the view is on, torchrun writes each worker's stdout and stderr to files
(``<log dir>/<run id>_<random>/attempt_<N>/<local rank>/stdout.log``, ``stderr.log``).
:class:`OutputTail` reads the new lines of the chosen local ranks' files, so that the
user's ``print()`` reaches the terminal (above the view's area, where it scrolls),
one line each, prefixed by the rank, as torchrun's ``--tee`` with
``--local-ranks-filter`` would print them without a view.
elastictrain's own event lines (JSON, already drawn by the view) are left out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

STREAMS = ("stdout", "stderr")
MAX_READ = 256_000  # bytes read from one file per poll: a chatty worker cannot stall the view


def parse_ranks(spec: str) -> frozenset[int] | None:
    """``--view-ranks``: ``all`` (None: every local rank), ``none`` (no rank), or local
    ranks separated by commas (``0,1``).

    Raises:
        ValueError: anything else, naming the accepted forms.
    """
    text = spec.strip().lower()
    if text == "all":
        return None
    if text == "none":
        return frozenset()
    try:
        ranks = frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        ranks = frozenset({-1})
    if not ranks or min(ranks) < 0:
        raise ValueError(f"--view-ranks {spec!r}: expected local ranks such as 0 or 0,1, "
                         "or all, or none")
    return ranks


def is_event_line(line: str) -> bool:
    """An elastictrain event as JSON (the view shows events its own way)."""
    if not line.startswith("{"):
        return False
    try:
        parsed = json.loads(line)
    except ValueError:
        return False
    return isinstance(parsed, dict) and "event" in parsed


@dataclass
class OutputTail:
    """New lines of the chosen local ranks' output files under ``log_dir``.

    Files already there when it is made (an earlier launch of the same run) are read
    from their end only. Args: log_dir: torchrun's ``--log-dir``; ranks: the local ranks
    to show (None: all).
    """

    log_dir: Path
    ranks: frozenset[int] | None = frozenset({0})
    _offsets: dict[Path, int] = field(default_factory=dict)
    _partial: dict[Path, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for path in self._files():
            try:
                self._offsets[path] = path.stat().st_size
            except OSError:  # gone since the listing: nothing of it to skip
                continue

    def _files(self) -> list[Path]:
        if self.ranks is not None and not self.ranks:
            return []
        found = []
        for stream in STREAMS:
            for path in self.log_dir.glob(f"*/attempt_*/*/{stream}.log"):
                rank = path.parent.name
                if rank.isdigit() and (self.ranks is None or int(rank) in self.ranks):
                    found.append(path)
        # Oldest change first: a worker's stdout and stderr lines of one poll come
        # roughly in the order it wrote them.
        return sorted(found, key=_changed)

    def poll(self, *, final: bool = False) -> list[str]:
        """The lines written since the last poll, each as ``[rank N] text``; ``final``:
        also a last line without its newline."""
        lines: list[str] = []
        for path in self._files():
            for text in self._read(path, final):
                if text.strip() and not is_event_line(text):
                    lines.append(f"[rank {path.parent.name}] {text.rstrip()}")
        return lines

    def _read(self, path: Path, final: bool) -> list[str]:
        start = self._offsets.get(path, 0)
        try:
            with open(path, "rb") as file:
                file.seek(start)
                data = file.read(MAX_READ)
        except OSError:
            return []
        self._offsets[path] = start + len(data)
        text = self._partial.pop(path, "") + data.decode("utf-8", errors="replace")
        lines = text.split("\n")
        rest = lines.pop()  # after the last newline: a line still being written
        if rest and final:
            lines.append(rest)
        elif rest:
            self._partial[path] = rest
        return lines


def _changed(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
