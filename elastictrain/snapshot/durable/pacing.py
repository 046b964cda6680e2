"""Holding a background persist to a byte rate (``snapshot.persist_max_mb_s``).

Where the persist and the training loop share the memory bus (two vCPUs of one core,
or a host whose loop is memory-bound), the persist's copy and checksum slow the loop
while they run, even on a core of their own. Spreading the same bytes over more time
lowers that slowdown at the cost of a snapshot durable later: docs/performance.md
("Pacing the persist") has the measured trade. When the run is ending (a preemption
notice, ``close``) the pace is lifted: the save in flight and every later one go at
full speed, since the time left, not the loop, is then what counts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Pace:
    """A byte rate for one saver's persists, and whether it has been lifted.

    ``lifted`` is a ``threading.Event``, or a ``multiprocessing`` one where a persister
    process reads it (``for_process``)."""

    bytes_per_s: float
    lifted: Any = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        if self.bytes_per_s <= 0:
            raise ValueError(f"a persist rate must be > 0 bytes/s, got {self.bytes_per_s}")

    @classmethod
    def for_process(cls, bytes_per_s: float, context: Any) -> Pace:
        """A pace a helper process started from ``context`` also sees lifted."""
        return cls(bytes_per_s, context.Event())

    def lift(self) -> None:
        """Full speed from the next write on, for good."""
        self.lifted.set()


class PacedWriter:
    """Forwards writes to ``sink``, sleeping after each one whose bytes arrived ahead of
    the pace counted from the first write. The caller's writes set the grain
    (``HashingWriter`` hands over 16 MiB pieces), so the rate holds over any window
    longer than a few pieces; the sleep releases the GIL for the training loop."""

    def __init__(self, sink: Any, pace: Pace,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._sink, self._pace = sink, pace
        self._clock, self._sleep = clock, sleep
        self._started: float | None = None
        self._sent = 0

    @classmethod
    def wrap(cls, sink: Any, pace: Pace | None) -> Any:
        """``sink`` itself when there is no pace."""
        return sink if pace is None else cls(sink, pace)

    def write(self, data: Any) -> int:
        if self._started is None:
            self._started = self._clock()
        n = int(self._sink.write(data))
        self._sent += n
        if self._pace.lifted.is_set():
            return n
        ahead = self._sent / self._pace.bytes_per_s - (self._clock() - self._started)
        if ahead > 0:
            self._sleep(ahead)
        return n

    def flush(self) -> None:
        self._sink.flush()
