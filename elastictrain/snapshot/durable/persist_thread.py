"""``ThreadPersister``: persists on one long-lived background thread of the worker.

The thread serialises with ``torch.save`` into a hashing writer that streams
to storage. Almost all of that time is spent in calls that release the GIL
(file writes, ``zlib.crc32`` on large buffers, fsync), so the training thread
rarely waits for the GIL; how much the loop still slows down is measured by
``scripts/bench_snapshot.py`` against ``ProcessPersister`` (see
docs/persister.md for the figures and the default).
"""

from __future__ import annotations

import contextvars
import queue
import threading
from typing import Any

from elastictrain.snapshot.durable.persister import (
    DEFAULT_BACKGROUND,
    Background,
    CommitGate,
    PersistOutcome,
    RetryPolicy,
    SaveHandle,
    SaveState,
    lower_priority,
    persist_with_retries,
    prune_after,
)
from elastictrain.snapshot.format.manifest import SnapshotMeta
from elastictrain.storage.api import Store

_Job = tuple[Any, SnapshotMeta, SaveHandle, contextvars.Context, CommitGate | None]


class ThreadPersister:
    """Persists staged snapshots on a daemon thread, one at a time.

    Events of a persist are logged in the context of the ``submit`` call, so
    they carry the worker's run_id, rank and step like every other event. A
    process that exits without ``close()`` abandons the write in flight; it is
    never committed (the commit marker comes last).
    """

    def __init__(self, store: Store, keep: int, policy: RetryPolicy,
                 background: Background = DEFAULT_BACKGROUND) -> None:
        self._store = store
        self._keep = keep
        self._policy = policy
        self._background = background
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="elastictrain-persist",
                                        daemon=True)
        self._thread.start()

    def submit(self, payload: Any, meta: SnapshotMeta,
               gate: CommitGate | None = None) -> SaveHandle:
        handle = SaveHandle(meta.step)
        self._jobs.put((payload, meta, handle, contextvars.copy_context(), gate))
        return handle

    def close(self) -> None:
        """Finish the queued save, then stop the thread."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def _run(self) -> None:
        lower_priority(self._background.priority)  # this thread's only: the loop keeps its own
        while (job := self._jobs.get()) is not None:
            payload, meta, handle, context, gate = job
            try:
                outcome = context.run(persist_with_retries, self._store, payload, meta,
                                      self._policy, None, gate,
                                      self._background.pace)
            except BaseException as exc:  # never leave a handle pending: wait() would hang
                outcome = PersistOutcome(SaveState.FAILED, error=f"{type(exc).__name__}: {exc}")
            handle._finish_with(outcome)  # durable now; the next save may stage meanwhile
            context.run(prune_after, self._store, self._keep, meta.step, outcome)
