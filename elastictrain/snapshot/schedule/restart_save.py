"""The snapshot before the agent restarts a healthy group: a node joins the job (or the
rendezvous re-forms while every worker is healthy), torchrun stops every worker and
starts the group again at the new size. Without this the new group resumes from the
last periodic snapshot and repeats the steps since.

Under ``elastictrain run`` the agent asks first (``rescue_marks.request_save``). Every
rank checks the request in the step's agreement (snapshot/schedule/save_schedule.py), so all
save the same step: to node memory when every node has one (milliseconds; a node that
joins receives it from a peer's memory), else to durable storage. Each then marks
itself ready and waits to be stopped, so no step is taken that the restart would lose.
A worker in ``close()`` marks itself ready at once, and one that has taken no step this
attempt (it restores) and takes none for a while after the request (``RestartRequest``)
soon after: neither has anything new to save. One that trained and pauses (it evaluates,
waits for data) is not: the agent waits for its next step, whose save the restart
resumes from, so a join repeats no completed step; a worker writing a rescue is never
marked ready by its pause either (the agent waits for the rescue). A worker that is
not stopped within ``RESTART_PAUSE_S`` (the node that was to join left before its agent
acted) goes on training.
"""

from __future__ import annotations

import contextvars
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from elastictrain.core.localfiles import open_private
from elastictrain.core.log import get_logger
from elastictrain.handoff.rescue_marks import (
    LISTENING,
    READY,
    launcher_marks_dir,
    save_requested,
)
from elastictrain.worker import watchdog
from elastictrain.worker.dist import DistContext

log = get_logger("elastictrain.snapshot")

# The agent waits for the saves up to launch.rescue_timeout_s (30 s by default) and
# stops the group as soon as they are marked; a worker waits as long for that.
RESTART_PAUSE_S = 30.0
WATCH_INTERVAL_S = 0.05  # how often a worker looks for the agent's request
IDLE_PATIENCE_S = 1.0  # no first step this long after it: ready without a save


class RestartRequest:
    """This worker's side of its agent's request for a save before a restart.

    The training thread answers it at a step (``requested``, then ``save_before_restart``).
    A worker that has taken no step this attempt (it restores) has nothing new to save: a
    small thread marks it ready once it has taken none for ``IDLE_PATIENCE_S`` since the
    request, so the agent does not wait for a first step that may be far away. A worker
    that has trained holds steps no snapshot may have yet, so its pause (an evaluation)
    is never taken for readiness: its next step saves.
    """

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._lock = threading.Lock()
        self._state = "idle"  # -> "saving" (the training thread took it) -> "ready"
        self._last_step_at = time.monotonic()
        self._stepped = False  # a step was taken this attempt
        self._closed = threading.Event()

    @classmethod
    def from_env(cls) -> RestartRequest | None:
        """The request channel of this worker's launcher, watched; None under a launcher
        that never asks (plain torchrun)."""
        directory = launcher_marks_dir()
        if directory is None:
            return None
        request = cls(directory)
        if not request._mark(LISTENING):
            return None  # the agent could not see an answer: it does not wait for one
        context = contextvars.copy_context()  # its event keeps run_id, rank, ...
        threading.Thread(target=context.run, args=(request._watch,), daemon=True,
                         name="elastictrain-restart-request").start()
        return request

    def close(self) -> None:
        self._closed.set()

    def stepped(self) -> None:
        """A step ended (before its agreement): from here on only a step answers."""
        self._stepped, self._last_step_at = True, time.monotonic()

    def requested(self) -> bool:
        """Whether the agent asked and this worker has not answered (one stat of a tmpfs
        file per step); True once: the training thread then saves."""
        with self._lock:
            if self._state != "idle" or not save_requested(self._directory):
                return False
            self._state = "saving"
            return True

    def saving(self) -> None:
        """The ranks agreed on a save for the restart (a peer's agent may have asked)."""
        with self._lock:
            if self._state == "idle":
                self._state = "saving"

    def ready(self) -> None:
        """Tell the agent it may stop this worker now (no more saves this attempt)."""
        with self._lock:
            self._mark_ready()

    def _mark_ready(self) -> None:
        if self._state == "ready":
            return
        self._state = "ready"
        self._mark(READY)  # if it fails, the agent waits launch.rescue_timeout_s instead

    def _mark(self, prefix: str) -> bool:
        try:
            os.close(open_private(self._directory / f"{prefix}{os.getpid()}",
                                  os.O_WRONLY | os.O_CREAT))
        except OSError as exc:  # a full tmpfs, a directory gone with its launcher
            log.warning("snapshot.restart_mark_failed", mark=prefix.rstrip("-"),
                        error=str(exc))
            return False
        return True

    def _watch(self) -> None:
        seen: float | None = None
        while not self._closed.wait(WATCH_INTERVAL_S):
            if self._state == "ready" or self._stepped:
                return  # a step answers from here on (the class docstring)
            if self._state != "idle" or not save_requested(self._directory):
                seen = None
                continue
            now = time.monotonic()
            seen = now if seen is None else seen
            idle_s = now - max(seen, self._last_step_at)
            if idle_s < IDLE_PATIENCE_S:
                continue
            with self._lock:
                if self._state == "idle":
                    log.info("snapshot.restart_ready_idle", idle_s=round(idle_s, 3))
                    self._mark_ready()
            return


def save_before_restart(ctx: DistContext, request: RestartRequest, step: int,
                        memory: Callable[[], bool] | None, durable: Callable[[], bool]) -> None:
    """Snapshot ``step`` for the restart the agent asked for (every rank calls it at the
    same step), mark it, and wait to be stopped.

    Args:
        memory: a memory snapshot of the step, committed; whether it committed on this
            rank's node. None without a memory tier.
        durable: the same to durable storage.
    """
    started = time.monotonic()
    request.saving()
    tier: str | None = None
    with watchdog.busy("snapshot.save_before_restart"):
        if memory is not None:
            (failed,) = ctx.all_reduce_max([int(not memory())])
            tier = None if failed else "memory"
        if tier is None:
            (failed,) = ctx.all_reduce_max([int(not durable())])
            tier = None if failed else "durable"
    if tier is None:
        log.warning("snapshot.restart_unsaved", snapshot_step=step,
                    action="the restart resumes from the newest snapshot")
    else:
        log.info("snapshot.saved_for_restart", snapshot_step=step, tier=tier,
                 duration_s=round(time.monotonic() - started, 4))
    request.ready()
    with watchdog.busy("snapshot.wait_for_restart"):
        left = watchdog.left_s()  # a short startup_timeout_s must not fire meanwhile
        pause = RESTART_PAUSE_S if left is None else min(RESTART_PAUSE_S, max(0.0, left - 1))
        threading.Event().wait(pause)  # the agent stops this process
    log.warning("snapshot.restart_not_taken", snapshot_step=step, waited_s=round(pause, 3),
                action="training goes on")
