"""Persisters write staged snapshots: serialise + checksum → write → commit → prune.

Lifecycle of one save (``SaveState``)::

    pending ──> committed   written, checksummed, committed (retention ran after)
            ──> skipped     the step was already committed and verifies, or this
                            rank does not write
            ──> failed      ``max_consecutive_failures`` attempts in a row failed;
                            ``SaveHandle.wait()`` raises SnapshotWriteFailed

Each failed attempt logs ``snapshot.failed`` (with ``will_retry``) and is retried
with exponential backoff (``retry_backoff_s * 2**k``) on the same staged state,
while training goes on. Three implementations share ``persist_with_retries``:
``SyncPersister`` (in the caller, blocking: ``mode="sync"``), and the
background ``ThreadPersister`` and ``ProcessPersister`` (``mode="async"``).
At most one save is in flight; the caller (``Saver``) waits before staging the
next one (back-pressure).
"""

from __future__ import annotations

import ctypes
import enum
import multiprocessing
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal, Protocol

from elastictrain.core.errors import SnapshotWriteFailed
from elastictrain.core.log import get_logger
from elastictrain.snapshot.durable.commit import persist_snapshot
from elastictrain.snapshot.durable.pacing import Pace
from elastictrain.snapshot.durable.retention import prune
from elastictrain.snapshot.format.manifest import Manifest, SnapshotMeta
from elastictrain.storage.api import Store
from elastictrain.storage.retry import RetryPolicy

log = get_logger("elastictrain.snapshot")

Priority = Literal["low", "normal"]


@dataclass(frozen=True)
class Background:
    """How a background persister shares the machine with the training loop: its CPU and
    I/O priority (``lower_priority``) and the pace its writes are held to (None: as
    fast as they go; snapshot/durable/pacing.py)."""

    priority: Priority = "normal"
    pace: Pace | None = None


DEFAULT_BACKGROUND = Background()

# Background work at "low" priority: CPU nice +10, I/O best-effort level 7 (Linux).
_LOW_NICE = 10
_IOPRIO_CLASS_BE, _IOPRIO_CLASS_SHIFT, _IOPRIO_LOWEST_BE = 2, 13, 7
_IOPRIO_WHO_PROCESS = 1
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 282}


def lower_priority(priority: Priority) -> None:
    """Run the calling thread (and threads it starts later) at ``priority``.

    "low": nice +10 and best-effort I/O level 7, so where the persist and the
    training loop (or its data loading) compete for a core or a disk, the loop
    wins; with a core and the disk to spare it changes nothing. A failure (not
    Linux, a seccomp filter) leaves the priority as it was: it is a preference.
    """
    if priority == "normal" or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + _LOW_NICE)
    except OSError as exc:
        log.debug("snapshot.priority_unchanged", kind="cpu", error=str(exc))
    number = _SYS_IOPRIO_SET.get(platform.machine())
    if number is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    value = (_IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT) | _IOPRIO_LOWEST_BE
    if libc.syscall(number, _IOPRIO_WHO_PROCESS, tid, value) != 0:
        log.debug("snapshot.priority_unchanged", kind="io",
                  error=os.strerror(ctypes.get_errno()))


# Asked just before a commit marker is written: True commits, False drops the save
# (a copy behind whose source changed, saver.py). It may block until it knows.
CommitGate = Callable[[], bool]


class CommitDropped(Exception):
    """The commit gate said no: the save ends skipped, never committed nor retried."""


class SaveState(str, enum.Enum):
    PENDING = "pending"
    COMMITTED = "committed"
    SKIPPED = "skipped"
    FAILED = "failed"


@dataclass(frozen=True)
class PersistOutcome:
    """What a persist ended with; plain data so it crosses a process boundary."""

    state: SaveState
    manifest_json: bytes | None = None
    error: str | None = None
    attempts: int = 1


class SaveHandle:
    """The result of one ``save()``: ``wait()`` blocks until durable, re-raising failures;
    ``add_done_callback`` is told the moment the outcome reaches this process."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.state = SaveState.PENDING
        self.manifest: Manifest | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._callbacks: list[Callable[[SaveHandle], None]] = []
        self._callbacks_lock = threading.Lock()  # a finish and an add may race
        # A copy behind's verdict (saver.py), taken by whoever waits first: the outcome
        # depends on it, so a wait must never start before it (it would never end).
        self._settle: Callable[[], object] | None = None

    def _finish(self, state: SaveState, manifest: Manifest | None = None,
                error: BaseException | None = None) -> None:
        self.state, self.manifest, self.error = state, manifest, error
        with self._callbacks_lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def _finish_with(self, outcome: PersistOutcome) -> None:
        manifest = (Manifest.from_json(outcome.manifest_json, f"step {self.step}")
                    if outcome.manifest_json is not None else None)
        error = SnapshotWriteFailed(outcome.error) if outcome.error is not None else None
        self._finish(outcome.state, manifest, error)

    def done(self) -> bool:
        return self._done.is_set()

    def add_done_callback(self, callback: Callable[[SaveHandle], None]) -> None:
        """Call ``callback(handle)`` once the save finished either way: on the thread
        that finishes it, or at once if it already has. It must not block."""
        with self._callbacks_lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def join(self, timeout: float | None = None) -> bool:
        """Block until the save finished either way (never raises); False on timeout."""
        if self._settle is not None:
            self._settle()
        return self._done.wait(timeout)

    def wait(self, timeout: float | None = None) -> Manifest | None:
        """Block until the save is durable; return its manifest (None if skipped).

        Raises:
            SnapshotWriteFailed: the persist failed ``max_consecutive_failures`` times.
            TimeoutError: not finished within ``timeout`` seconds.
        """
        if not self.join(timeout):
            raise TimeoutError(f"snapshot of step {self.step} not durable after {timeout}s")
        if self.error is not None:
            raise self.error
        return self.manifest

    @classmethod
    def completed(cls, step: int) -> SaveHandle:
        """A handle for ranks that do not write (nothing to wait for)."""
        handle = cls(step)
        handle._finish(SaveState.SKIPPED)
        return handle


# Store calls that count as progress when they return (open_write counts its bytes).
_OPERATIONS = frozenset({"write_bytes", "read_bytes", "read_into", "list_dir", "exists",
                         "size", "delete", "rename"})


class CountingStore:
    """Forwards to a Store; counts progress: bytes written through ``open_write``, and
    one for each other storage call that returned (a commit's small writes, retention).

    The count lives in shared memory, so the worker reads it while a persister
    thread or process writes: a count that moves is how a wait on a slow persist
    tells progress from a hang (``watchdog.wait_moving``).
    """

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self._written = multiprocessing.get_context("spawn").RawValue("q", 0)

    @property
    def progress(self) -> int:
        return int(self._written.value)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(name)  # unpickling probes attributes before __dict__ is set
        attr = getattr(self.inner, name)
        if name not in _OPERATIONS:
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            result = attr(*args, **kwargs)
            self._written.value += 1  # one persist thread or process: no lock needed
            return result
        return counted

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        with self.inner.open_write(path) as sink:
            yield _CountingSink(sink, self._written)  # type: ignore[misc]


class _CountingSink:
    # torch.save hands a whole tensor storage over in one write; counting per chunk
    # lets a slow link show progress within one large tensor.
    _CHUNK_BYTES = 256 << 10

    def __init__(self, sink: BinaryIO, written: Any) -> None:
        self._sink, self._written = sink, written

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, self._CHUNK_BYTES):
            chunk = view[start:start + self._CHUNK_BYTES]
            self._sink.write(chunk)
            self._written.value += chunk.nbytes  # one writer: no lock needed
        return view.nbytes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)  # flush, fileno (local files keep early writeback)


class Persister(Protocol):
    """Writes staged snapshots; the caller keeps at most one in flight.

    ``submit`` takes ownership of ``payload`` (staged buffers) until the
    returned handle is done; ``close`` waits for the save in flight.
    """

    def submit(self, payload: Any, meta: SnapshotMeta,
               gate: CommitGate | None = None) -> SaveHandle: ...
    def close(self) -> None: ...


def persist_with_retries(store: Store, payload: Any, meta: SnapshotMeta, policy: RetryPolicy,
                         before_commit: Callable[[], None] | None = None,
                         gate: CommitGate | None = None,
                         pace: Pace | None = None) -> PersistOutcome:
    """Persist and commit one snapshot, retrying failed attempts with backoff.

    Logs ``snapshot.failed`` per failed attempt and ``snapshot.committed`` on
    success. ``before_commit`` runs just before the commit marker is written
    (a persister process checks there that its worker is still alive).
    Retention is separate (``prune_after``): a save is durable at its commit,
    and deleting old snapshots need not delay the next save. ``gate``, asked after
    ``before_commit``, may drop the save (``skipped``, logged by whoever decided).
    ``pace`` paces each attempt's write (``Background``).
    """
    check = _gated(before_commit, gate)
    failures = 0
    while True:
        started = time.perf_counter()
        try:
            manifest = persist_snapshot(store, payload, meta, before_commit=check,
                                        pace=pace)
        except CommitDropped:
            return PersistOutcome(SaveState.SKIPPED, attempts=failures + 1)
        except Exception as exc:
            failures += 1
            will_retry = failures < policy.max_consecutive_failures
            log.error("snapshot.failed", snapshot_step=meta.step, attempt=failures,
                      error=str(exc), error_type=type(exc).__name__, will_retry=will_retry,
                      retry_in_s=policy.delay_s(failures) if will_retry else None,
                      duration_s=round(time.perf_counter() - started, 4))
            if not will_retry:
                return PersistOutcome(SaveState.FAILED, error=_give_up_message(
                    store, meta.step, failures, exc), attempts=failures)
            time.sleep(policy.delay_s(failures))  # backoff before retrying, not synchronisation
            continue
        if manifest is None:
            return PersistOutcome(SaveState.SKIPPED, attempts=failures + 1)
        duration = time.perf_counter() - started
        log.info("snapshot.committed", snapshot_step=meta.step, size_bytes=manifest.total_bytes,
                 duration_s=round(duration, 4), attempts=failures + 1,
                 throughput_mb_s=round(manifest.total_bytes / max(duration, 1e-9) / 1e6, 1))
        return PersistOutcome(SaveState.COMMITTED, manifest.to_json(), attempts=failures + 1)


def _gated(before_commit: Callable[[], None] | None,
           gate: CommitGate | None) -> Callable[[], None] | None:
    if gate is None:
        return before_commit

    def check() -> None:
        if before_commit is not None:
            before_commit()
        if not gate():
            raise CommitDropped
    return check


def prune_after(store: Store, keep: int, step: int, outcome: PersistOutcome) -> None:
    """Retention after a commit; a failure is logged, never raised (the save is durable)."""
    if outcome.state != SaveState.COMMITTED:
        return
    try:
        prune(store, keep, step)
    except Exception as exc:
        log.warning("snapshot.prune_failed", snapshot_step=step, error=str(exc),
                    error_type=type(exc).__name__)


def _give_up_message(store: Store, step: int, failures: int, exc: Exception) -> str:
    return (f"snapshot of step {step} to {store.url} failed {failures} times in a row "
            f"(snapshot.max_consecutive_failures={failures}); last error: "
            f"{type(exc).__name__}: {exc}; fix: make the storage writable and reachable, "
            "or raise snapshot.max_consecutive_failures / retry_backoff_s")


class SyncPersister:
    """Persists in the caller's thread (``mode="sync"``): fully blocking."""

    def __init__(self, store: Store, keep: int, policy: RetryPolicy) -> None:
        self._store = store
        self._keep = keep
        self._policy = policy

    def submit(self, payload: Any, meta: SnapshotMeta,
               gate: CommitGate | None = None) -> SaveHandle:
        handle = SaveHandle(meta.step)
        outcome = persist_with_retries(self._store, payload, meta, self._policy, gate=gate)
        handle._finish_with(outcome)
        prune_after(self._store, self._keep, meta.step, outcome)
        return handle

    def close(self) -> None:
        return None
