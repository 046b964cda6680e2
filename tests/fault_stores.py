"""Storage wrappers that fail or stall on purpose (tests only).

They wrap a real Store and are picklable, so they behave the same inside a
persister process. State that a test must observe from outside (which writes
started and ended) goes to a journal file, appended line by line.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from elastictrain.core import layout
from elastictrain.core.errors import StorageError, StorageTransientError
from elastictrain.storage.api import Store


class _Wrapper:
    """Forwards everything to ``inner`` except what a subclass overrides."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _is_payload(path: str) -> bool:
    return path.endswith("/" + layout.PAYLOAD)


class FailingStore(_Wrapper):
    """The first ``failures`` payload writes raise a StorageError (counted per process)."""

    def __init__(self, inner: Store, failures: int) -> None:
        super().__init__(inner)
        self.failures_left = failures

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        if _is_payload(path) and self.failures_left > 0:
            self.failures_left -= 1
            raise StorageError(f"write {self.inner.url}/{path}: injected failure")
        with self.inner.open_write(path) as sink:
            yield sink


class GatedStore(_Wrapper):
    """Payload writes journal their start and end; a write stalls after its first
    ``stall_after`` bytes until the file ``gate`` exists (never, if nobody creates it).

    Args:
        journal: file that gets one line per event: ``start <step> pid=<pid>``, ``end <step>``.
        gate: path whose existence lets stalled writes continue.
        stall_steps: only these steps stall (default: every step).
    """

    def __init__(self, inner: Store, journal: str, gate: str, stall_after: int = 4096,
                 stall_steps: set[int] | None = None) -> None:
        super().__init__(inner)
        self.journal, self.gate, self.stall_after = journal, gate, stall_after
        self.stall_steps = stall_steps

    def _note(self, line: str) -> None:
        with open(self.journal, "a") as f:
            f.write(line + "\n")

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        if not _is_payload(path):
            with self.inner.open_write(path) as sink:
                yield sink
            return
        step = _step_of(path)
        self._note(f"start {step} pid={os.getpid()}")
        with self.inner.open_write(path) as sink:
            if self.stall_steps is None or step in self.stall_steps:
                yield _StallingSink(sink, self.stall_after, self.gate)  # type: ignore[misc]
            else:
                yield sink
        self._note(f"end {step}")


class _StallingSink:
    def __init__(self, sink: BinaryIO, stall_after: int, gate: str) -> None:
        self._sink, self._left, self._gate = sink, stall_after, gate

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        if self._left > 0:
            head = view[: self._left]
            self._sink.write(head)
            self._sink.flush()  # the partial payload is on disk while the write stalls
            self._left -= head.nbytes
            view = view[head.nbytes:]
        if view.nbytes:
            while not Path(self._gate).exists():
                time.sleep(0.01)  # the write under test waits for the test's gate (a condition)
            self._sink.write(view)
        return size

    def flush(self) -> None:
        self._sink.flush()


def _step_of(path: str) -> int:
    for part in path.split("/"):
        step = layout.parse_step(part)
        if step is not None:
            return step
        if part.startswith(layout.PARTIAL_PREFIX + "step_"):
            return int(part[len(layout.PARTIAL_PREFIX) + 5:].split("-", 1)[0])
    raise ValueError(path)


def read_journal(path: str | Path) -> list[str]:
    p = Path(path)
    return p.read_text().splitlines() if p.exists() else []


class FailingReads(_Wrapper):
    """Reads (``read_bytes``, ``open_read``, ``read_into``) of paths containing ``match`` raise a
    StorageTransientError, as a throttled or timed-out read that outlived the store's
    retries does; the first ``failures`` of them, or all while ``failures`` is None."""

    def __init__(self, inner: Store, match: str = layout.SNAPSHOTS,
                 failures: int | None = None) -> None:
        super().__init__(inner)
        self.match, self.failures_left = match, failures
        self.failed = 0

    def _maybe_fail(self, path: str) -> None:
        if self.match in path and (self.failures_left is None or self.failures_left > 0):
            if self.failures_left is not None:
                self.failures_left -= 1
            self.failed += 1
            raise StorageTransientError(f"read {self.inner.url}/{path}: injected throttling "
                                        "(SlowDown) after retries")

    def read_bytes(self, path: str) -> bytes:
        self._maybe_fail(path)
        return self.inner.read_bytes(path)

    @contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        self._maybe_fail(path)
        with self.inner.open_read(path) as f:
            yield f

    def read_into(self, path: str, buffer: Any, offset: int = 0, *,
                  object_size: int | None = None) -> int:
        self._maybe_fail(path)
        return int(self.inner.read_into(path, buffer, offset, object_size=object_size))


class SwitchedStore(_Wrapper):
    """Payload writes raise a StorageError while the file ``fail_while`` exists (a
    switch a test flips from outside the job's processes)."""

    def __init__(self, inner: Store, fail_while: str) -> None:
        super().__init__(inner)
        self.fail_while = fail_while

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        if _is_payload(path) and Path(self.fail_while).exists():
            raise StorageError(f"write {self.inner.url}/{path}: injected failure (switch on)")
        with self.inner.open_write(path) as sink:
            yield sink


class TricklingStore(_Wrapper):
    """Payload writes move ``chunk_bytes`` every ``delay_s``: a slow upload that keeps
    making progress (the watchdog must not call it a hang)."""

    def __init__(self, inner: Store, chunk_bytes: int, delay_s: float) -> None:
        super().__init__(inner)
        self.chunk_bytes, self.delay_s = chunk_bytes, delay_s

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        with self.inner.open_write(path) as sink:
            if _is_payload(path):
                yield _TricklingSink(sink, self.chunk_bytes, self.delay_s)  # type: ignore[misc]
            else:
                yield sink


class _TricklingSink:
    def __init__(self, sink: BinaryIO, chunk_bytes: int, delay_s: float) -> None:
        self._sink, self._chunk, self._delay = sink, chunk_bytes, delay_s

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, self._chunk):
            self._sink.write(view[start:start + self._chunk])
            time.sleep(self._delay)  # the simulated link's speed, not synchronisation
        return view.nbytes

    def flush(self) -> None:
        self._sink.flush()
