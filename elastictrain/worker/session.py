"""The worker's process-wide state after ``elastictrain.init()`` (``elastictrain/runtime.py``):
its settings, environment and process group, where its events go, and whether the run's
end was logged. What a ``SnapshotManager`` built without ``ctx``/``config`` finds; the
manager moves the event file beside its snapshots (``events_beside``) and logs the end
(``log_finished``) here, without importing ``init``'s module."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastictrain.core import log as et_log
from elastictrain.core.config import Settings, StorageConfig
from elastictrain.core.env import LAUNCH_ID_VAR, WorkerEnv, getenv
from elastictrain.core.localfiles import remove_empty_dirs
from elastictrain.runlog import events
from elastictrain.worker.dist import DistContext


@dataclass
class Runtime:
    """What a worker needs after ``init``: its settings, environment and process group."""

    settings: Settings
    env: WorkerEnv
    ctx: DistContext
    events_dir: str | None
    run_id: str = ""
    events_file_name: str = ""
    events_moved: bool = False  # events_beside already chose the storage
    finished: bool = False  # run.finished was logged

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def device(self) -> Any:
        return self.ctx.device


_current: Runtime | None = None  # what init() returned in this process (set_current)


def events_beside(storage: StorageConfig, run_id: str) -> None:
    """Move this worker's event file beside the snapshots at ``storage``, under the run
    id of the job they hold (``runlog/run_marker.py``; the module docstring's rule:
    ``SnapshotManager`` calls it): the first manager decides, and a configured
    ``log.events_dir`` is left alone."""
    rt = _current
    if rt is None or rt.events_moved:
        return
    rt.events_moved = True
    if run_id != rt.run_id:  # a relaunch joins the run its storage holds
        rt.run_id = run_id
        et_log.bind(run_id=run_id)
    if rt.settings.log.events_dir:
        return
    moved = rt.settings.model_copy(update={"storage": storage})
    sink = events.open_sink(moved, rt.run_id, rt.events_file_name)
    old_dir = Path(rt.events_dir) if rt.events_dir else None
    if rt.events_dir is not None and sink.path.parent == old_dir:
        return
    # Under elastictrain run (it sets the launch id) the launcher's live view and agent
    # watch the old directory: a link there keeps the worker's events in their sight.
    launched = bool(getenv(LAUNCH_ID_VAR))
    et_log.move_events_file(sink.path, sink.upload, leave_link=launched)
    rt.events_dir = str(sink.path.parent)
    if old_dir is not None and launched:  # the launcher brings its files there at the end
        with contextlib.suppress(OSError):
            events.write_moved_to(old_dir, events.launch_id(), events.MovedTo(
                storage.url, run_id, os.path.abspath(rt.events_dir)))
    if old_dir is not None and not launched:
        remove_empty_dirs(old_dir, levels=3)  # <run id>/, events/, the default storage root


def log_finished(**fields: Any) -> None:
    """Log ``run.finished`` once (rank 0): the script ended cleanly. Not while an error
    propagates (a ``finally`` around the loop): that is no clean end."""
    rt = _current
    if sys.exc_info()[1] is not None or (rt is not None and rt.finished):
        return
    if rt is not None:
        rt.finished = True
        if rt.rank != 0:
            return
    fields.setdefault("final_step", structlog_step())
    et_log.get_logger("elastictrain").info("run.finished", **fields)


def structlog_step() -> int | None:
    """The step bound to this process's events (the manager re-binds it every step)."""
    import structlog

    step = structlog.contextvars.get_contextvars().get("step")
    return step if isinstance(step, int) else None


def current() -> Runtime | None:
    """What ``init`` returned in this process (None before ``init`` or after ``shutdown``)."""
    return _current




def set_current(runtime: Runtime | None) -> None:
    """What ``init`` returned (None after ``shutdown``)."""
    global _current
    _current = runtime
