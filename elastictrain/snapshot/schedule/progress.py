"""What the training loop's steps leave behind besides snapshots: the highest step
each rank reached (a restart reports the steps it lost) and the periodic
``train.progress`` event."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastictrain.core.localfiles import make_private_dirs, open_private
from elastictrain.core.log import get_logger
from elastictrain.snapshot.state.sense_check import loss_value

log = get_logger("elastictrain.snapshot")


_PREFIX = "progress-rank"


class ProgressFile:
    """The highest step this rank reached, in a local file rewritten in place each step
    (a 20-byte pwrite, no fsync): after a crash the next attempt reads it to report
    how many steps were lost."""

    def __init__(self, directory: str | Path, rank: int) -> None:
        make_private_dirs(Path(directory))
        self._path = Path(directory) / f"{_PREFIX}{rank}"
        self._fd: int | None = None

    def read(self) -> int | None:
        """The highest step any rank that wrote beside this one reached (None: none
        did). Every rank's file counts, not only this rank's: after a node is replaced
        the rendezvous may give this node's workers other ranks than before."""
        steps = []
        for path in self._path.parent.glob(f"{_PREFIX}*"):
            try:
                steps.append(int(path.read_text().strip() or "0"))
            except (OSError, ValueError):  # gone, or torn by a crash mid-write
                continue
        return max(steps, default=None)

    def write(self, step: int) -> None:
        if self._fd is None:
            self._fd = open_private(self._path, os.O_WRONLY | os.O_CREAT)
        os.pwrite(self._fd, f"{step:>20d}".encode(), 0)


class ProgressReport:
    """A ``train.progress`` event at most every ``every_s`` seconds (the views' step
    rate and loss), so the training path never logs per step; None: never."""

    def __init__(self, every_s: float | None, clock: Callable[[], float]) -> None:
        self._every_s, self._clock = every_s, clock
        self._last = clock()

    def step(self, loss: Any) -> None:
        """``loss`` (float or 0-d tensor) is read only when the event is due."""
        now = self._clock()
        if self._every_s is None or now - self._last < self._every_s:
            return
        self._last = now
        value = loss_value(loss)
        log.info("train.progress", loss=None if value is None else round(value, 6))
