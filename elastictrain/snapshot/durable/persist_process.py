"""``ProcessPersister``: persists in a long-lived helper process of the worker.

The helper is started once, with the ``spawn`` start method (never ``fork``:
the worker has threads, and a forked copy of a process with threads can
deadlock). Staged state lives in shared-memory slabs (``StagingBuffers(
share_memory=True)``); each slab's handle crosses the pipe once, and every
later save sends only a small skeleton of views into the slabs, so a save
costs the worker a few microseconds of pickling, not a copy.

The helper dies with its worker. It sets ``PR_SET_PDEATHSIG`` (Linux: the
kernel SIGKILLs it when the worker dies, even by SIGKILL), checks that its
parent is still the worker right after that, and checks again just before it
writes a commit marker. A worker killed mid-persist therefore never leaves an
orphan that commits a snapshot while the restarted workers already run; the
partial write is ignored by discovery and removed by retention.
``PR_SET_PDEATHSIG`` fires when the *thread* that started the helper exits,
so the helper is started from the training thread (the first ``save()``).

The helper's events are forwarded to the worker and logged there with the
worker's context (run_id, rank, step), in the worker's event file.
"""

from __future__ import annotations

import atexit
import contextvars
import ctypes
import faulthandler
import functools
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from elastictrain.core.errors import SnapshotWriteFailed
from elastictrain.core.log import configure_forwarding, get_logger, log_forwarded
from elastictrain.snapshot.durable.pacing import Pace
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
from elastictrain.snapshot.format.views import as_bytes, from_views, to_views
from elastictrain.storage.api import Store

log = get_logger("elastictrain.snapshot")

_PR_SET_PDEATHSIG = 1
_EXIT_ORPHANED = 3
_exiting = threading.Event()  # interpreter exit: multiprocessing terminates helpers, quietly
atexit.register(_exiting.set)


class ProcessPersister:
    """Persists staged snapshots in a helper process, one at a time.

    Args:
        store: where snapshots go; pickled to the helper (it must be picklable
            and reach the same storage from another process: not ``memory://``).
        keep: retention, applied by the helper after each commit.
        policy: retries of a failed persist.
    """

    def __init__(self, store: Store, keep: int, policy: RetryPolicy,
                 background: Background = DEFAULT_BACKGROUND) -> None:
        mp = torch_mp.get_context("spawn")
        self._conn, child_conn = mp.Pipe(duplex=True)
        self._proc = mp.Process(target=helper_main, name="elastictrain-persister", daemon=True,
                                args=(child_conn, store, keep, policy, os.getpid(), background))
        with _main_module_hidden():
            self._proc.start()
        child_conn.close()
        self._storages: dict[int, tuple[torch.UntypedStorage, int]] = {}
        self._next_key = 0
        self._lock = threading.Lock()
        self._reap_lock = threading.Lock()
        self._inflight: tuple[SaveHandle, contextvars.Context, CommitGate | None] | None = None
        self._send_lock = threading.Lock()  # the reader thread answers gates on this pipe
        self._context = contextvars.copy_context()
        self._dead = False
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="elastictrain-persist-reader",
                                        daemon=True)
        self._reader.start()
        log.info("snapshot.persister_started", kind="process", pid=self._proc.pid)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def submit(self, payload: Any, meta: SnapshotMeta,
               gate: CommitGate | None = None) -> SaveHandle:
        handle = SaveHandle(meta.step)
        skeleton, new, forget = self._encode(payload)
        with self._lock:
            dead = self._dead
            if not dead:
                self._inflight = (handle, contextvars.copy_context(), gate)
        if dead:
            handle._finish(SaveState.FAILED, error=SnapshotWriteFailed(self._death(meta.step)))
            return handle
        try:
            with self._send_lock:
                self._conn.send(("save", meta, skeleton, new, forget, gate is not None))
        except (OSError, EOFError):
            self._fail_inflight()  # the helper is gone; the reader reports how it ended
        return handle

    def close(self) -> None:
        """Stop the helper after the save in flight (the caller waited for it)."""
        self._closing = True
        with suppress(OSError, EOFError), self._send_lock:
            self._conn.send(("close",))
        if not self._reap(60):
            log.warning("snapshot.persister_killed", pid=self._proc.pid,
                        reason="did not exit within 60 s of close()")
            self._proc.kill()
            self._reap(None)
        self._reader.join(timeout=10)
        self._conn.close()

    def _reap(self, timeout: float | None) -> bool:
        """Join the helper; True once it has exited. One thread at a time: the reader
        thread joins too, and of two concurrent joins one loses the race for
        ``waitpid`` (ECHILD), which multiprocessing reports as a live process."""
        with self._reap_lock:
            self._proc.join(timeout)
            return self._proc.exitcode is not None

    # -- the worker's side of the pipe -----------------------------------------------
    def _encode(self, payload: Any) -> tuple[Any, dict[int, torch.Tensor], list[int]]:
        """The payload as views into storages; storages the helper lacks go along (as
        shared-memory handles), storages no longer used are forgotten on both sides."""
        new: dict[int, torch.Tensor] = {}
        used: set[int] = set()

        def key_of(storage: torch.UntypedStorage) -> int:
            entry = self._storages.get(storage.data_ptr())
            if entry is None:
                key, self._next_key = self._next_key, self._next_key + 1
                # Holding the storage keeps its address from being reused by another one.
                entry = self._storages[storage.data_ptr()] = (storage, key)
                new[key] = as_bytes(storage)
            used.add(entry[1])
            return entry[1]

        skeleton = to_views(payload, key_of)
        stale = [ptr for ptr, (_, key) in self._storages.items() if key not in used]
        forget = [self._storages.pop(ptr)[1] for ptr in stale]
        return skeleton, new, forget

    def _read(self) -> None:
        while True:
            try:
                kind, body = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                inflight = self._inflight
                if kind == "done":
                    self._inflight = None
            if inflight is not None:
                self._context = inflight[1]  # retention logs after "done" keep the save's context
            context = self._context
            if kind == "log":
                context.run(log_forwarded, body)
            elif kind == "gate":  # the helper waits before its commit: ask in this process
                gate = inflight[2] if inflight is not None else None
                with suppress(OSError), self._send_lock:
                    self._conn.send(("gate", gate() if gate is not None else True))
            elif kind == "done" and inflight is not None:
                inflight[0]._finish_with(body)
        self._reap(10)
        with self._lock:
            self._dead = True
        if not (self._closing or _exiting.is_set()):
            self._context.run(log.error, "snapshot.persister_died", pid=self._proc.pid,
                              exit_code=self._proc.exitcode)
        self._fail_inflight()

    def _fail_inflight(self) -> None:
        with self._lock:
            inflight, self._inflight = self._inflight, None
        if inflight is not None and not inflight[0].done():
            inflight[0]._finish(SaveState.FAILED,
                                error=SnapshotWriteFailed(self._death(inflight[0].step)))

    def _death(self, step: int) -> str:
        return (f"the snapshot persister process (pid {self._proc.pid}) exited with code "
                f"{self._proc.exitcode} before step {step} was committed; fix: look for an "
                "out-of-memory kill (dmesg), or set snapshot.persister='thread'")


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start a spawned child without re-running the training script in it.

    ``spawn`` re-imports ``__main__`` in the child by path or module name; a
    training script without an ``if __name__ == "__main__":`` guard would then
    train again inside the helper (``dcp.async_save``'s process mode hangs for
    this reason). The helper needs nothing from ``__main__``.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    names = ("__file__", "__spec__")
    saved: dict[str, Any] = {k: main.__dict__[k] for k in names if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


# -- the helper process -------------------------------------------------------------
def helper_main(conn: Any, store: Store, keep: int, policy: RetryPolicy, parent_pid: int,
                background: Background = DEFAULT_BACKGROUND) -> None:
    """The helper's loop: receive a staged save, persist it, report the outcome."""
    _die_with_parent(parent_pid)
    lower_priority(background.priority)  # before any thread starts: they inherit it
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: stacks
    torch.set_num_threads(1)  # the worker's training loop owns the other cores
    configure_forwarding(lambda event: conn.send(("log", event)))
    storages: dict[int, torch.Tensor] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message[0] != "save":
            break
        _, meta, skeleton, new, forget, gated = message
        for key in forget:
            storages.pop(key, None)
        storages.update(new)
        gate = functools.partial(_ask_gate, conn) if gated else None
        outcome = _persist(store, from_views(skeleton, storages), meta, policy, parent_pid,
                           gate, background.pace)
        conn.send(("done", outcome))  # durable now; the worker may stage the next save
        prune_after(store, keep, meta.step, outcome)
    conn.close()
    # Everything written is fsynced and closed; skip interpreter teardown (about a second
    # with torch loaded), so close() returns promptly.
    os._exit(0)


def _persist(store: Store, payload: Any, meta: SnapshotMeta, policy: RetryPolicy,
             parent_pid: int, gate: CommitGate | None,
             pace: Pace | None) -> PersistOutcome:
    try:
        return persist_with_retries(store, payload, meta, policy,
                                    before_commit=lambda: _exit_if_orphaned(parent_pid),
                                    gate=gate, pace=pace)
    except BaseException as exc:  # report, never leave the worker's handle pending
        return PersistOutcome(SaveState.FAILED, error=f"{type(exc).__name__}: {exc}")


def _ask_gate(conn: Any) -> bool:
    """The worker's commit gate for the save in flight (its reader thread answers;
    nothing else arrives on the pipe while a save is in flight)."""
    conn.send(("gate", None))
    kind, allowed = conn.recv()
    return kind == "gate" and bool(allowed)


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _exit_if_orphaned(parent_pid)  # the worker may have died before prctl took effect


def _exit_if_orphaned(parent_pid: int) -> None:
    if os.getppid() != parent_pid:
        os._exit(_EXIT_ORPHANED)  # nobody to report to; never commit for a dead worker
