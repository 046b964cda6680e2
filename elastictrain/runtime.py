"""``init()`` / ``shutdown()``: the two calls around a training script.

``init`` reads the worker environment once, configures structured logging
with the run's context bound (run_id, rank, world_size, restart_count), joins
the process group, and installs a ``sys.excepthook`` under which an
:class:`~elastictrain.errors.ElasticTrainError` reaching the top of the script
logs one ``worker.error`` event and exits with the error's ``exit_code`` (78 for
a fatal one: the launcher's agent then stops restarting). Any other exception
logs ``worker.failed`` and goes on to the previous hook (exit 1). Either way the
error (type, message, file:line, step, this worker's event file) is also written to
torchrun's per-worker error file (``TORCHELASTIC_ERROR_FILE``), where the agent
reads it for its failure summary and its crash-loop rule (agent.py): that file is
the one channel that reaches the agent under plain and standby-forked workers alike,
wherever the events go. What it returns is also ``current()``, where a
``SnapshotManager`` built without ``ctx``/``config`` finds it. ``shutdown`` logs
``run.finished`` for a clean end (unless ``SnapshotManager.close`` did), destroys the
group and restores the previous hook.

Where the events go (the rule): ``log.events_dir`` when set; otherwise beside the
snapshots: ``<storage>/events/<run id>/``, with ``<storage>`` the URL the script
passes to its first ``SnapshotManager`` (``events_beside``; on object storage the
file is spooled locally and uploaded there, elastictrain.events). ``init`` runs
before any manager exists, so it opens the file under ``storage.url`` (the setting,
default ``./elastictrain-run``) and the manager moves it, with what it holds so far;
a script without a manager keeps it there. This needs no launcher, so plain torchrun
and ``elastictrain run`` put events in the same place; under ``elastictrain run`` a
symbolic link is left in the launcher's events directory (its live view and summary
read the workers' events there, beside the agent's).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from elastictrain import events, preempt, watchdog
from elastictrain import log as et_log
from elastictrain.config import Settings, StorageConfig, load_settings
from elastictrain.dist import DistContext, destroy_process_group, init_process_group
from elastictrain.env import LAUNCH_ID_VAR, WorkerEnv, getenv
from elastictrain.errors import EXIT_FATAL, ElasticTrainError
from elastictrain.snapshot import rescue

ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


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


_current: Runtime | None = None  # what init() returned in this process


def default_events_dir(settings: Settings) -> str | None:
    """The local root of event files (``elastictrain.events``: beside the snapshots for
    local storage, a spool directory uploaded to the storage for object storage)."""
    return events.events_root(settings)


def init(settings: Settings | None = None, **overrides: Any) -> Runtime:
    """Set up logging and join the process group from the torchrun environment.

    Args:
        settings: complete settings; built with ``load_settings(**overrides)`` if None.
    """
    settings = settings or load_settings(**overrides)
    env = WorkerEnv.from_environ()
    run_id = settings.run_id or env.run_id
    launch = events.launch_id()
    sink = events.open_sink(settings, run_id,
                            events.worker_file_name(env.restart_count, env.rank, launch))
    et_log.configure(settings.log.level, settings.log.json_output, sink.path, upload=sink.upload)
    et_log.bind(run_id=run_id, rank=env.rank, world_size=env.world_size,
                restart_count=env.restart_count, launch_id=launch, step=0,
                **env.scheduler_attempts)
    log = et_log.get_logger("elastictrain")
    log.info("worker.start", pid=os.getpid(), local_rank=env.local_rank)
    _install_excepthook()  # from here an ElasticTrainError exits with its own code
    ctx = init_process_group(settings.dist, env)
    et_log.bind(rank=ctx.rank, world_size=ctx.world_size)
    # A notice from here on is acted on at the first step boundary; until that first
    # step the watchdog allows startup_timeout_s. One file/URL poller per node is enough.
    preempt.install(settings.preempt, poll=env.local_rank == 0)
    watchdog.install(settings.watchdog)
    global _current
    _current = Runtime(settings, env, ctx, str(sink.path.parent), run_id,
                       sink.path.name)
    # What was imported so far (torch alone: some 190 thousand objects) leaves the cyclic
    # collector's view: its full collections during training no longer walk it, nor does
    # the interpreter's exit (figures: docs/recovery.md#the-garbage-collector).
    gc.freeze()
    return _current


def events_beside(storage: StorageConfig) -> None:
    """Move this worker's event file beside the snapshots at ``storage`` (the module
    docstring's rule; ``SnapshotManager`` calls it): the first manager decides, and
    a configured ``log.events_dir`` is left alone."""
    rt = _current
    if rt is None or rt.events_moved or rt.settings.log.events_dir:
        return
    rt.events_moved = True
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
    if old_dir is not None and not launched:
        _remove_empty(old_dir, levels=3)  # <run id>/, events/, the default storage root


def _remove_empty(directory: Path, levels: int) -> None:
    """Remove ``directory`` and up to ``levels - 1`` parents while they are empty (what
    ``init`` created for the events before they moved)."""
    for _ in range(levels):
        try:
            directory.rmdir()
        except OSError:  # not empty (another rank's file, snapshots) or gone
            return
        directory = directory.parent


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


def shutdown() -> None:
    """Leave the process group (call at the end of training, also on errors)."""
    global _current
    failing = sys.exc_info()[1]
    if failing is not None:  # from a ``finally`` while an error propagates: the rescue
        rescue.on_uncaught(failing)  # goes first, before the agent stops this process
    elif _current is not None:
        log_finished()  # a script without SnapshotManager.close() ends cleanly here
    watchdog.uninstall()  # teardown is not a hang
    # Handlers stay: a late SIGTERM from the agent must not turn exit 75 into a kill.
    preempt.uninstall(restore_signals=False)
    destroy_process_group()
    _current = None
    # Called from a ``finally`` while an error propagates, the hook must stay for it.
    if sys.exc_info()[1] is None:
        _restore_excepthook()


# The hook init() replaced; None while ours is not installed.
_previous_hook: ExceptHook | None = None


def _install_excepthook() -> None:
    global _previous_hook
    if _previous_hook is None:
        _previous_hook = sys.excepthook
        sys.excepthook = exit_on_error


def _restore_excepthook() -> None:
    global _previous_hook
    if _previous_hook is not None:
        sys.excepthook = _previous_hook
        _previous_hook = None


def exit_on_error(exc_type: type[BaseException], exc: BaseException,
                  tb: TracebackType | None) -> None:
    """``sys.excepthook`` after ``init``: our errors exit with their code, others pass on.

    An uncaught exception otherwise exits 1, which torchrun restarts even when a
    restart cannot help (bad config, resume mismatch, access denied). A
    ``SystemExit`` raised by the hook sets the interpreter's exit status.
    """
    rescue.on_uncaught(exc)  # a survivor commits its last step to node memory
    failure = describe_failure(exc, tb)
    record_failure(failure, tb, with_traceback=not isinstance(exc, ElasticTrainError))
    log = et_log.get_logger("elastictrain")
    if not isinstance(exc, ElasticTrainError):
        log.error("worker.failed", **failure, exit_code=1)
        (_previous_hook or sys.__excepthook__)(exc_type, exc, tb)
        return
    log.error("worker.error", **failure, exit_code=exc.exit_code,
              fatal=exc.exit_code == EXIT_FATAL)
    raise SystemExit(exc.exit_code)


def describe_failure(exc: BaseException, tb: TracebackType | None) -> dict[str, Any]:
    """What a failure summary says of an uncaught error: its type, message, the
    file:line it was raised at, the step, and this worker's event file."""
    frames = traceback.extract_tb(tb)
    log_file = et_log.events_file()
    return {"error": type(exc).__name__, "message": str(exc)[:2000],
            "where": f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None,
            "failed_step": structlog_step(),
            "log_file": None if log_file is None else os.path.abspath(log_file)}


# torchrun gives each worker this file; its agent reads it when the worker fails.
ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"


def record_failure(failure: dict[str, Any], tb: TracebackType | None,
                   with_traceback: bool = True) -> None:
    """Write ``failure`` to torchrun's error file for this worker, in torch's own
    format (its ``message``; torchrun's failure report prints ``py_callstack``) plus
    ours under ``elastictrain`` (agent.py reads it). Without ``with_traceback`` (our
    own errors, whose message says what to fix) the report gets one line, not a
    traceback. Best effort: the exit must still happen."""
    path = os.environ.get(ERROR_FILE_VAR)
    if not path:
        return
    headline = f"{failure['error']}: {failure['message']}"
    stack = ("Traceback (most recent call last):\n" + "".join(traceback.format_tb(tb))
             + headline if with_traceback else f"{headline} (at {failure['where']})")
    data = {"message": {"message": headline,
                        "extraInfo": {"py_callstack": stack,
                                      "timestamp": str(int(time.time()))}},
            "elastictrain": {**failure, "ts": time.time()}}
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # Whole or absent, never torn: the agent reads it once this process exits, and
        # a kill during the write would otherwise leave it half written.
        partial = Path(f"{path}.{os.getpid()}.partial")
        partial.write_text(json.dumps(data, default=str), encoding="utf-8")
        partial.replace(path)
    except OSError:
        pass


