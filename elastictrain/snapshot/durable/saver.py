"""The writer rank's save pipeline: back-pressure → stage → persist in the background.

Call order (rank 0; other ranks only take part in the manager's RNG gather)::

    saver.wait_in_flight(step) # back-pressure: wait for the save in flight
                               # (snapshot.backpressure), watched as progress
    saver.failed_step()        # the manager agrees on a failure on every rank …
    saver.take_failure()       # … and raises it everywhere at the same step
    saver.save(state, meta)    # copy into staging buffers (snapshot.staged) →
                               # hand the staged state to the persister
    saver.fence()              # copy behind only: before the sources change again,
                               # wait for the copies the save deferred (snapshot.copy_wait)
    saver.close()              # wait for the save in flight, stop the persister

One save is in flight at a time: staging buffers are reused, so the next save
must not overwrite them while they are being written.

Copy behind (``snapshot.overlap_copy``): the tensors the manager names (parameters
and optimizer state, which only the optimizer's step changes) are copied on a
thread while the loop runs the next forward and backward; the persister gets the
state once they are copied, and ``fence()`` (the optimizer's step pre-hook) waits
for them. What is left of the copy then is the only blocking (docs/performance.md).
A copy whose source changed in place before it was done (its version counter moved:
another optimizer, an update outside ``optimizer.step()``) drops that save
(``snapshot.copy_raced``, never committed), and copies are made at once from then on.
The versions are compared on the training thread, by ``fence()`` (or a wait on the
save), never by the copy thread when its copy ends: an in-place kernel bumps the
version only once it has finished, so one still running then would pass that check
with half its writes in the copy. On the training thread every in-place op it started
has returned, so an unchanged version means the copy saw none of them. The persist
writes meanwhile and commits only after that verdict (a change after the copy and
before the fence also drops the save: the two cannot be told apart).

The persister is a thread by default (``persister="process"`` is the option
for loops that hold the GIL far more): measured in docs/persister.md.
"""

from __future__ import annotations

import contextvars
import functools
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any, cast

import torch
from structlog.contextvars import bound_contextvars

from elastictrain.core.errors import SnapshotWriteFailed
from elastictrain.core.log import get_logger
from elastictrain.snapshot.durable.pacing import Pace
from elastictrain.snapshot.durable.persister import (
    Background,
    CommitGate,
    CountingStore,
    Persister,
    RetryPolicy,
    SaveHandle,
    SaveState,
    SyncPersister,
)
from elastictrain.snapshot.durable.restore import LoadedSnapshot, load_newest
from elastictrain.snapshot.durable.saver_interface import LoadRequest, SaverSettings
from elastictrain.snapshot.format.manifest import SnapshotMeta
from elastictrain.snapshot.state.staging import StagingBuffers
from elastictrain.storage.api import Store
from elastictrain.worker import watchdog

log = get_logger("elastictrain.snapshot")


def background_pace(settings: SaverSettings, kind: str) -> Pace | None:
    """The pace of a saver's background writes; a synchronous save is never paced (the
    loop waits for it)."""
    rate = settings.persist_max_bytes_per_s
    if rate is None or kind == "sync":
        return None
    if kind == "process":  # the helper process reads whether it was lifted
        return Pace.for_process(rate, multiprocessing.get_context("spawn"))
    return Pace(rate)


def choose_persister(settings: SaverSettings, store: Store) -> str:
    """``sync``, ``thread`` or ``process`` for these settings and store.

    A helper process cannot reach a ``memory://`` store (it lives in this
    process's memory), so that falls back to a thread.
    """
    if settings.mode == "sync":
        return "sync"
    if settings.persister == "process" and store.url.startswith("memory://"):
        return "thread"
    return settings.persister


class InFlightSave:
    """The last save, whether its failure was reported, and the waits on it: shared by
    :class:`Saver` and the sharded saver. A wait counts bytes written and storage calls
    made through ``counted_store`` (``watchdog.wait_moving``): a persist that keeps
    moving is no hang. ``tier`` ("durable" or "memory") goes into this saver's events."""

    def __init__(self, store: Store, tier: str = "durable") -> None:
        self.tier = tier
        self._counted = CountingStore(store)  # bytes and calls: progress for the watchdog
        self._last: SaveHandle | None = None
        self._reported: SaveHandle | None = None
        self.pace: Pace | None = None  # snapshot.persist_max_mb_s, where it applies

    def hurry(self) -> None:
        """The run is ending: the save in flight and every later one at full speed."""
        if self.pace is not None:
            self.pace.lift()

    @property
    def counted_store(self) -> Store:
        """The store every persist of this saver writes through."""
        return cast(Store, self._counted)

    def failed_step(self) -> int:
        """The step of the last save if it failed and was not yet reported, else 0."""
        last = self._last
        if last is not None and last.state == SaveState.FAILED and last is not self._reported:
            return last.step
        return 0

    def take_failure(self) -> BaseException | None:
        """The last save's SnapshotWriteFailed if not yet reported; reported from now on."""
        if not self.failed_step():
            return None
        assert self._last is not None
        self._reported = self._last
        return self._last.error

    def wait_in_flight(self, step: int) -> None:
        """Back-pressure: wait for the save in flight (never raises), logged if it waited."""
        last = self._last
        if last is None or last.done():
            return
        started = time.perf_counter()
        self._join()
        log.info("snapshot.backpressure", snapshot_step=step, waiting_for_step=last.step,
                 wait_s=round(time.perf_counter() - started, 4), tier=self.tier)

    def wait(self) -> None:
        """Block until the last save is durable; raise its failure if not yet reported."""
        self._join()
        failure = self.take_failure()
        if failure is not None:
            raise failure

    def _join(self) -> None:
        last = self._last
        if last is not None:
            watchdog.wait_moving(last.join, self._progress)

    def _progress(self) -> int:
        """What the watchdog sees move while a wait lasts: this rank's storage progress."""
        return self._counted.progress


class Saver(InFlightSave):
    """Stages state and hands it to a background persister, one save at a time.

    The durable tier and the node-memory tier are two Savers on two Stores; their
    events carry ``tier``. The manager holds the model and optimizer state in the
    state it hands over (``saves_model_and_optimizer`` is False)."""

    saves_model_and_optimizer = False

    def __init__(self, store: Store, settings: SaverSettings, tier: str = "durable") -> None:
        self.store = store
        self.kind = choose_persister(settings, store)
        self.staging = StagingBuffers(share_memory=self.kind == "process")
        super().__init__(store, tier)
        self._keep = settings.keep
        self._policy = RetryPolicy(settings.max_consecutive_failures, settings.retry_backoff_s)
        self.pace = background_pace(settings, self.kind)
        self._background = Background(settings.persister_priority, self.pace)
        self._persister: Persister | None = None
        self._behind: _CopyBehind | None = None
        self._copier = _CopyThread()
        self.copy_behind = True  # until a copy behind races a change of its source

    def warm_up(self) -> None:
        """Start the persister now (a helper process imports torch for seconds), from
        the training thread, so the first save does not wait for it."""
        _ = self.persister

    @property
    def persister(self) -> Persister:
        """The persister, started on first use (from the training thread)."""
        if self._persister is None:
            self._persister = self._start_persister()
        return self._persister

    def save(self, state: Any, meta: SnapshotMeta, started: float | None = None,
             defer: AbstractSet[int] = frozenset()) -> SaveHandle:
        """Stage ``state`` and start persisting it; returns at once in async mode.

        The caller has taken the previous save's failure, if any (``take_failure``).

        Args:
            started: ``time.perf_counter()`` when the save began (for ``duration_s``).
            defer: ``data_ptr()`` of CPU tensors to copy behind (async mode only); the
                caller calls :meth:`fence` before any of them changes.
        """
        started = time.perf_counter() if started is None else started
        self.wait_in_flight(meta.step)  # staging buffers are reused: never while in flight
        self.fence()
        staged, later = self.staging.stage_deferring(state, defer if self.kind != "sync"
                                                     else frozenset())
        # Bound while submitting: the persister logs in a copy of this context.
        with bound_contextvars(tier=self.tier):
            log.info("snapshot.staged", snapshot_step=meta.step, size_bytes=self.staging.nbytes,
                     duration_s=round(time.perf_counter() - started, 4), persister=self.kind,
                     copy_behind=len(later))
            persister = self.persister
            if later:
                behind = _CopyBehind(later, functools.partial(persister.submit, staged, meta),
                                     meta.step, self._copier.run)
                behind.handle._settle = functools.partial(self._settle, behind)
                self._behind = behind
                self._last = behind.handle
            else:
                self._last = persister.submit(staged, meta)
        return self._last

    def fence(self) -> float:
        """Return once the copies the last save deferred are done (at once if none are
        pending) and judged: a source changed since the save drops it
        (``snapshot.copy_raced``). Call it on the training thread, before the sources
        change again. A wait is logged as ``snapshot.copy_wait``: it blocked the loop.
        Returns the seconds waited."""
        behind = self._behind
        return 0.0 if behind is None else self._settle(behind)

    def _settle(self, behind: _CopyBehind) -> float:
        """``fence()`` for ``behind``; also what a wait on its handle runs first."""
        if self._behind is behind:
            self._behind = None
        waited = 0.0
        if not behind.copied.is_set():
            started = time.perf_counter()
            behind.copied.wait()
            waited = time.perf_counter() - started
            log.info("snapshot.copy_wait", snapshot_step=behind.handle.step, tier=self.tier,
                     wait_s=round(waited, 4))
        changed = behind.settle()
        if changed is not None:
            self._copy_raced(behind.handle.step, changed)
        return waited

    def _join(self) -> None:
        self.fence()  # the persist of a copy behind waits for this verdict
        super()._join()

    def _copy_raced(self, step: int, source: torch.Tensor) -> None:
        """A copy behind saw its source change before it was done: that save is
        dropped, and every later save copies at once."""
        self.copy_behind = False
        log.warning("snapshot.copy_raced", snapshot_step=step, tier=self.tier,
                    tensor=f"{source.dtype} {tuple(source.shape)}",
                    reason="a parameter or optimizer state tensor changed in place before "
                    "its copy behind was done (a second optimizer, or an update outside "
                    "optimizer.step())",
                    action="snapshot dropped, never committed; later saves copy at once",
                    fix="give the manager the optimizer that changes these tensors, or set "
                    "snapshot.overlap_copy=false")

    def prepare_ahead(self, make_state: Callable[[], Any]) -> None:
        """Allocate the staging slabs the state needs off the training loop, so the first
        save blocks only as long as the later ones (``make_state`` is called only until
        the first save: it allocates whatever is still missing itself)."""
        if not self.staging.staged:
            self.staging.prepare_async(make_state())

    def load_newest(self, request: LoadRequest) -> LoadedSnapshot | None:
        """The newest verified snapshot of this saver's store (or, newer, of the memory
        tier's: ``request.memory_first``) as a payload that holds the model and
        optimizer state too."""
        return load_newest(self.store, request.ctx, request.restore_mode,
                           request.in_place, request.memory_first)

    def close(self) -> None:
        """Wait for the save in flight (at full speed) and stop the persister; raise a
        failure not yet raised."""
        self.hurry()
        try:
            self.wait()
        finally:
            self.staging.wait_prepared()
            self._copier.close()
            if self._persister is not None:
                self._persister.close()
                self._persister = None

    def _start_persister(self) -> Persister:
        store = self.counted_store
        if self.kind == "sync":
            return SyncPersister(store, self._keep, self._policy)
        if self.kind == "thread":
            from elastictrain.snapshot.durable.persist_thread import ThreadPersister

            log.info("snapshot.persister_started", kind="thread")
            return ThreadPersister(store, self._keep, self._policy, self._background)
        from elastictrain.snapshot.durable.persist_process import ProcessPersister

        return ProcessPersister(store, self._keep, self._policy, self._background)


class _CopyThread:
    """The one thread that runs a saver's copies behind, one save after another (saves
    never overlap: ``wait_in_flight``). One long-lived thread, not one per save:
    ``Thread.start`` waits until the new thread runs, which the loop would wait for.
    A daemon, like the persisters' threads: a hung persist never holds up exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] | None = None

    def run(self, job: Callable[[], None]) -> None:
        if self._jobs is None:  # each thread has its own queue: close() ends that one
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(self._jobs,), name="et-copy-behind",
                             daemon=True).start()
        self._jobs.put(job)

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while (job := jobs.get()) is not None:
            job()

    def close(self) -> None:
        """The thread ends after the job it runs, if any (a later ``run`` starts anew)."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None


class _CopyBehind:
    """The copies one save deferred, on a thread, then that save's persist, whose commit
    waits for the training thread's verdict on the copies (:meth:`settle`): the bytes
    are written meanwhile, as without copy behind.

    ``handle`` is what the saver hands out: it finishes with the persist's outcome
    (skipped if a source changed, failed if a copy raised). ``copied`` is set once the
    copy thread no longer reads the sources.
    """

    def __init__(self, copies: list[tuple[torch.Tensor, torch.Tensor]],
                 submit: Callable[[CommitGate], SaveHandle], step: int,
                 run: Callable[[Callable[[], None]], None]) -> None:
        self.handle = SaveHandle(step)
        self.copied = threading.Event()
        # In-place changes bump a tensor's version; the save's values are these versions'.
        self._copies = [(buffer, source, source._version) for buffer, source in copies]
        self._submit = submit
        self._lock = threading.Lock()
        self._judged = threading.Event()
        self._changed: torch.Tensor | None = None  # the verdict: None keeps the save
        context = contextvars.copy_context()  # the persister logs with the caller's binding
        run(functools.partial(context.run, self._run))

    def settle(self) -> torch.Tensor | None:
        """(training thread, after ``copied``) The first source whose version moved since
        the save, or None; lets the persist commit (None) or drop the save.
        Only the first call judges (and so reports a change); later ones return None."""
        with self._lock:
            if self._judged.is_set():
                return None
            self._changed = next((source for _, source, version in self._copies
                                  if source._version != version), None)
            self._judged.set()
            return self._changed

    def _may_commit(self) -> bool:
        """The persist's commit gate: blocks until the verdict."""
        self._judged.wait()
        return self._changed is None

    def _run(self) -> None:
        try:
            changed = False
            try:
                for buffer, source, version in self._copies:
                    changed = source._version != version
                    if changed:
                        break
                    buffer.copy_(source)  # releases the GIL: the loop runs meanwhile
            finally:
                self.copied.set()
            if changed:  # versions only grow: the verdict can only drop it, write nothing
                self.handle._finish(SaveState.SKIPPED)
                return
            inner = self._submit(self._may_commit)
            inner.join()
            self.handle._finish(inner.state, inner.manifest, inner.error)
        except BaseException as exc:  # never leave the handle pending: waits would hang
            self.handle._finish(SaveState.FAILED, error=SnapshotWriteFailed(
                f"snapshot of step {self.handle.step}: copying or handing over its state failed: "
                f"{type(exc).__name__}: {exc}"))
