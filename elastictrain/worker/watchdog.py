"""Hang watchdog: no step progress for too long → dump every thread's stack → exit 71.

A rank stuck in a collective (a peer that never joins, a wedged NCCL
communicator, a deadlocked data loader) otherwise waits for the collective
timeout, often 10-30 minutes, while torchrun's agent sees a live process. The
watchdog turns "no progress" into an exit (:data:`~elastictrain.core.errors.EXIT_HANG`),
so torchrun restarts the group and training resumes from the newest snapshot.

Lifecycle::

    armed(startup_timeout_s) ──first beat()──▶ armed(timeout_s) ──beat()──▶ …
    any state ──busy() section──▶ armed(startup_timeout_s) from the section's start
              ──section ends──▶ armed, clock reset
    armed ──no beat for the limit──▶ fired: ``watchdog.fired`` with every thread's
                                     stack, then os._exit(71)

``SnapshotManager.step()`` beats; ``restore`` and the staging of a save run
inside :class:`busy` sections, which may take long but not forever: up to
``startup_timeout_s`` (a restore waiting on a peer that never comes is a hang).
Waiting for a persist (back-pressure, ``wait``, ``close``, the final snapshot of
a preemption) is not a busy section but
:func:`wait_moving`: bytes written count as progress, so a slow upload is not
a hang and a stalled one is. Wrap long work between steps (evaluation) in
``with elastictrain.worker.watchdog.busy("eval"):``.

A ``faulthandler`` backstop, re-armed from the training thread, exits even when
a thread holds the GIL forever. Why a thread in the worker and not
``torch.distributed.elastic.timer``: docs/faults.md.
"""

from __future__ import annotations

import contextvars
import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import ContextDecorator
from typing import Any

from elastictrain.core.config import WatchdogConfig
from elastictrain.core.errors import EXIT_HANG
from elastictrain.core.log import get_logger

log = get_logger("elastictrain.watchdog")


class Watchdog:
    """Fires when neither a step nor a busy section has ended within the limit.

    Args:
        config: limits and check interval.
        exit_fn: how to leave once fired (``os._exit``; replaced in unit tests).
    """

    def __init__(self, config: WatchdogConfig, exit_fn: Callable[[int], Any] = os._exit) -> None:
        self.config = config
        self._exit_fn = exit_fn
        self._last = time.monotonic()
        self._step: int | None = None
        self._busy = 0
        self._busy_reason: str | None = None
        self._lock = threading.Lock()
        self._armed_at = -1e9
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = False

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> Watchdog:
        self._last = time.monotonic()
        self._arm_backstop()
        # A copy of the caller's context: events keep the bound run_id, rank, world size.
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._loop,),
                                        name="elastictrain-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.config.check_interval_s + 1)
        self._thread = None
        if self.config.backstop:
            faulthandler.cancel_dump_traceback_later()

    # -- progress ----------------------------------------------------------------------
    def beat(self, step: int) -> None:
        """A step completed (called by ``SnapshotManager.step`` in the training thread)."""
        first = self._step is None  # the limit drops from startup to step: re-arm now
        self._step = step
        self._moved(rearm=first)

    def progress(self) -> None:
        """Work between two steps moved (a persist wrote bytes): the limit restarts
        (training thread, outside busy sections)."""
        self._moved(rearm=False)

    def _moved(self, *, rearm: bool) -> None:
        self._last = now = time.monotonic()
        if rearm or now - self._armed_at >= self.config.check_interval_s:
            self._arm_backstop()

    def enter_busy(self, reason: str) -> None:
        """Start a section that may take long, up to ``startup_timeout_s`` (training
        thread)."""
        with self._lock:
            self._busy += 1
            self._busy_reason = reason
            if self._busy == 1:
                self._last = time.monotonic()  # the section's limit counts from its start
                self._arm_backstop()

    def exit_busy(self) -> None:
        with self._lock:
            self._busy = max(0, self._busy - 1)
            # The limit counts from the end of the section: a long save is followed
            # by a normal step, not by an instant fire.
            self._last = time.monotonic()
            if self._busy == 0:
                self._arm_backstop()

    @property
    def limit_s(self) -> float:
        """The current limit: startup until the first step and inside busy sections,
        else the step limit."""
        if self._step is None or self._busy:
            return self.config.startup_timeout_s
        return self.config.timeout_s

    def left_s(self) -> float:
        """Seconds before it fires if nothing moves (negative: overdue)."""
        return self.limit_s - (time.monotonic() - self._last)

    def idle_s(self, now: float | None = None) -> float | None:
        """Seconds without progress if over the limit, else None."""
        idle = (time.monotonic() if now is None else now) - self._last
        return idle if idle > self.limit_s else None

    # -- firing ------------------------------------------------------------------------
    def _loop(self) -> None:
        interval = self.config.check_interval_s
        while not self._stop.wait(interval):
            idle = self.idle_s()
            if idle is not None:
                self.fire(idle)
                return

    def _arm_backstop(self) -> None:
        # Fires only if nothing re-arms it: a little after this watchdog would have fired.
        if self.config.backstop and not self._stop.is_set():
            self._armed_at = time.monotonic()
            delay = self.limit_s + 3 * self.config.check_interval_s + 5
            faulthandler.dump_traceback_later(delay, exit=True)

    def fire(self, idle_s: float) -> None:
        """Log every thread's stack (``watchdog.fired``), then exit with EXIT_HANG."""
        self.fired = True
        stacks = thread_stacks()
        log.error("watchdog.fired", idle_s=round(idle_s, 3), timeout_s=self.limit_s,
                  phase="startup" if self._step is None else "step", last_step=self._step,
                  step=self._step,
                  exit_code=EXIT_HANG, threads=len(stacks), stacks=stacks)
        try:  # the same stacks, human-readable, in torchrun's per-rank log
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        if self.config.backstop:
            faulthandler.cancel_dump_traceback_later()
        self._exit_fn(EXIT_HANG)


def thread_stacks() -> dict[str, list[str]]:
    """Every other thread's current Python stack, innermost frame last, keyed by name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks: dict[str, list[str]] = {}
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # the caller (the watchdog itself) is not what is stuck
        lines = [line.rstrip("\n") for line in traceback.format_stack(frame)]
        stacks[f"{names.get(ident, 'thread')}:{ident}"] = lines
    return stacks


class busy(ContextDecorator):
    """A section that may take long without being a hang (snapshot I/O, evaluation).

    A no-op when no watchdog is installed; usable as a decorator.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __enter__(self) -> busy:
        if _current is not None:
            _current.enter_busy(self.reason)
        return self

    def __exit__(self, *exc: object) -> None:
        if _current is not None:
            _current.exit_busy()


# -- the process-wide watchdog -----------------------------------------------------------
_current: Watchdog | None = None


def install(config: WatchdogConfig) -> Watchdog | None:
    """Start the process-wide watchdog (``elastictrain.init`` calls this)."""
    global _current
    uninstall()
    if not config.enabled:
        return None
    _current = Watchdog(config).start()
    return _current


def uninstall() -> None:
    """Stop the process-wide watchdog (``elastictrain.shutdown`` calls this)."""
    global _current
    if _current is not None:
        _current.stop()
        _current = None


def current() -> Watchdog | None:
    return _current


def beat(step: int) -> None:
    """Report a completed step to the process-wide watchdog, if any."""
    if _current is not None:
        _current.beat(step)


def left_s() -> float | None:
    """Seconds before the process-wide watchdog fires if nothing moves (None: none)."""
    return None if _current is None else _current.left_s()


def wait_moving(join: Callable[[float | None], bool], moved: Callable[[], int]) -> None:
    """Block until ``join(timeout)`` returns True, watched by the watchdog as progress.

    Unlike a :class:`busy` section this wait has a limit: each change of ``moved()``
    (bytes a persist wrote) counts as progress, so a slow upload that keeps moving
    is not a hang, while one that moves nothing for the limit fires the watchdog.
    """
    dog = _current
    if dog is None:
        join(None)
        return
    seen = moved()
    while not join(dog.config.check_interval_s):
        now = moved()
        if now != seen:
            seen = now
            dog.progress()
