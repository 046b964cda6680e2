"""Holding a background persist to a byte rate (``snapshot.persist_max_mb_s``).

Where the persist and the training loop share the memory bus (two vCPUs of one core,
or a host whose loop is memory-bound), the persist's copy and checksum slow the loop
while they run, even on a core of their own. Spreading the same bytes over more time
lowers that slowdown at the cost of a snapshot durable later: docs/performance.md
("Pacing the persist") has the measured trade.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class PacedWriter:
    """Forwards writes to ``sink``, sleeping after each one whose bytes arrived ahead of
    ``bytes_per_s`` counted from the first write. The caller's writes set the grain
    (``HashingWriter`` hands over 16 MiB pieces), so the rate holds over any window
    longer than a few pieces; the sleep releases the GIL for the training loop."""

    def __init__(self, sink: Any, bytes_per_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"a persist rate must be > 0 bytes/s, got {bytes_per_s}")
        self._sink, self._rate = sink, bytes_per_s
        self._clock, self._sleep = clock, sleep
        self._started: float | None = None
        self._sent = 0

    @classmethod
    def wrap(cls, sink: Any, bytes_per_s: float | None) -> Any:
        """``sink`` itself when there is no limit."""
        return sink if bytes_per_s is None else cls(sink, bytes_per_s)

    def write(self, data: Any) -> int:
        if self._started is None:
            self._started = self._clock()
        n = int(self._sink.write(data))
        self._sent += n
        ahead = self._sent / self._rate - (self._clock() - self._started)
        if ahead > 0:
            self._sleep(ahead)
        return n

    def flush(self) -> None:
        self._sink.flush()
