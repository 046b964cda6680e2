"""Persisters run ``persist_snapshot`` + ``prune`` for staged state.

Lifecycle of one save (``SaveState``): ``pending`` → ``committed`` |
``skipped`` (the step was already committed) | ``failed``. ``SaveHandle.wait()``
returns the manifest or re-raises the persist's error.
"""

from __future__ import annotations

import enum
import threading
import time
from typing import Any, Protocol

from elastictrain.log import get_logger
from elastictrain.snapshot.manifest import Manifest
from elastictrain.snapshot.writer import SnapshotMeta, persist_snapshot, prune
from elastictrain.storage.api import Store

log = get_logger("elastictrain.snapshot")


class SaveState(str, enum.Enum):
    PENDING = "pending"
    COMMITTED = "committed"
    SKIPPED = "skipped"
    FAILED = "failed"


class SaveHandle:
    """The result of one ``save()``: ``wait()`` blocks until durable, re-raising failures."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.state = SaveState.PENDING
        self.manifest: Manifest | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()

    def _finish(self, state: SaveState, manifest: Manifest | None = None,
                error: BaseException | None = None) -> None:
        self.state, self.manifest, self.error = state, manifest, error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Manifest | None:
        if not self._done.wait(timeout):
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


class Persister(Protocol):
    """Writes staged snapshots; at most one in flight."""

    def submit(self, payload: Any, meta: SnapshotMeta) -> SaveHandle: ...
    def close(self) -> None: ...


def run_persist(store: Store, payload: Any, meta: SnapshotMeta, keep: int,
                handle: SaveHandle) -> None:
    """Persist, commit and prune one snapshot, recording the outcome on ``handle``."""
    started = time.perf_counter()
    try:
        manifest = persist_snapshot(store, payload, meta)
    except Exception as exc:
        log.error("snapshot.failed", snapshot_step=meta.step, error=str(exc),
                  error_type=type(exc).__name__,
                  duration_s=round(time.perf_counter() - started, 4))
        handle._finish(SaveState.FAILED, error=exc)
        return
    duration = time.perf_counter() - started
    if manifest is None:
        handle._finish(SaveState.SKIPPED)
        return
    log.info("snapshot.committed", snapshot_step=meta.step, size_bytes=manifest.total_bytes,
             duration_s=round(duration, 4),
             throughput_mb_s=round(manifest.total_bytes / max(duration, 1e-9) / 1e6, 1))
    handle._finish(SaveState.COMMITTED, manifest=manifest)
    try:
        prune(store, keep, meta.step)
    except Exception as exc:  # retention failing must not fail a committed save
        log.warning("snapshot.prune_failed", error=str(exc))


class SyncPersister:
    """Persists in the caller's thread: the simplest, fully blocking mode."""

    def __init__(self, store: Store, keep: int) -> None:
        self._store = store
        self._keep = keep

    def submit(self, payload: Any, meta: SnapshotMeta) -> SaveHandle:
        handle = SaveHandle(meta.step)
        run_persist(self._store, payload, meta, self._keep, handle)
        return handle

    def close(self) -> None:
        return None
