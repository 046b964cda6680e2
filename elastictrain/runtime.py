"""``init()`` / ``shutdown()``: the two calls around a training script.

``init`` reads the worker environment once, configures structured logging
with the run's context bound (run_id, rank, world_size, restart_count), joins
the process group, and installs a ``sys.excepthook`` under which an
:class:`~elastictrain.core.errors.ElasticTrainError` reaching the top of the script
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
file is spooled locally and uploaded there, elastictrain.runlog.events). ``init`` runs
before any manager exists, so it opens the file under ``storage.url`` (the setting,
default ``./elastictrain-run``) and the manager moves it, with what it holds so far;
a script without a manager keeps it there. This needs no launcher, so plain torchrun
and ``elastictrain run`` put events in the same place; under ``elastictrain run`` a
symbolic link is left in the launcher's events directory (its live view and summary
read the workers' events there, beside the agent's).
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

from elastictrain.core import log as et_log
from elastictrain.core.config import Settings, load_settings
from elastictrain.core.env import WorkerEnv
from elastictrain.core.errors import EXIT_FATAL, ElasticTrainError
from elastictrain.runlog import events
from elastictrain.runlog.failure import traceback_tail, write_error_file
from elastictrain.snapshot.memory import rescue
from elastictrain.worker import preempt, session, watchdog
from elastictrain.worker.dist import destroy_process_group, init_process_group
from elastictrain.worker.session import Runtime, structlog_step

ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


# What a script started without a launcher (``python train.py``) is told.
NO_LAUNCHER = ("no launcher: this process runs alone, with no process group (a "
               "DistributedDataParallel model cannot be built) and no restarts; fix: "
               "elastictrain run --nproc-per-node N train.py ..., or torchrun")


def init(settings: Settings | None = None, **overrides: Any) -> Runtime:
    """Set up logging and join the process group from the torchrun environment.

    Args:
        settings: complete settings; built with ``load_settings(**overrides)`` if None.
    """
    # First: a bad setting read here is a fatal one-line error (exit 78), not a traceback.
    _install_excepthook()
    settings = settings or load_settings(**overrides)
    env = WorkerEnv.from_environ()
    run_id = settings.run_id or env.run_id
    launch = events.launch_id()
    sink = events.open_sink(settings, run_id,
                            events.worker_file_name(env.restart_count, env.rank, launch))
    et_log.configure(settings.log.level, json_output=settings.log.json_output,
                     events_file=sink.path, upload=sink.upload)
    et_log.bind(run_id=run_id, rank=env.rank, world_size=env.world_size,
                restart_count=env.restart_count, launch_id=launch, step=0,
                **env.scheduler_attempts)
    log = et_log.get_logger("elastictrain")
    log.info("worker.start", pid=os.getpid(), local_rank=env.local_rank)
    if not env.is_distributed:
        log.warning("worker.no_launcher", message=NO_LAUNCHER)
    ctx = init_process_group(settings.dist, env)
    et_log.bind(rank=ctx.rank, world_size=ctx.world_size)
    # A notice from here on is acted on at the first step boundary; until that first
    # step the watchdog allows startup_timeout_s. One file/URL poller per node is enough.
    preempt.install(settings.preempt, poll=env.local_rank == 0)
    watchdog.install(settings.watchdog)
    runtime = Runtime(settings, env, ctx, str(sink.path.parent), run_id, sink.path.name)
    session.set_current(runtime)
    # What was imported so far (torch alone: some 190 thousand objects) leaves the cyclic
    # collector's view: its full collections during training no longer walk it, nor does
    # the interpreter's exit (figures: docs/recovery.md#the-garbage-collector).
    gc.freeze()
    return runtime


def shutdown() -> None:
    """Leave the process group (call at the end of training, also on errors)."""
    failing = sys.exc_info()[1]
    if failing is not None:  # from a ``finally`` while an error propagates: the rescue
        rescue.on_uncaught(failing)  # goes first, before the agent stops this process
    elif session.current() is not None:
        session.log_finished()  # a script without SnapshotManager.close() ends cleanly here
    watchdog.uninstall()  # teardown is not a hang
    # Handlers stay: a late SIGTERM from the agent must not turn exit 75 into a kill.
    preempt.uninstall(restore_signals=False)
    destroy_process_group()
    session.set_current(None)
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
    formatted = "".join(traceback.format_tb(tb) + traceback.format_exception_only(exc))
    return {"error": type(exc).__name__, "message": str(exc)[:2000],
            "where": f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None,
            "failed_step": structlog_step(),
            "traceback": traceback_tail(formatted.splitlines()),
            "log_file": None if log_file is None else os.path.abspath(log_file)}


# torchrun gives each worker this file; its agent reads it when the worker fails.
ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"


def record_failure(failure: dict[str, Any], tb: TracebackType | None,
                   *, with_traceback: bool = True) -> None:
    """Write ``failure`` to torchrun's error file for this worker
    (``runlog.failure.write_error_file``). Without ``with_traceback`` (our own errors,
    whose message says what to fix) torchrun's report gets one line, not a traceback."""
    path = os.environ.get(ERROR_FILE_VAR)
    if not path:
        return
    headline = f"{failure['error']}: {failure['message']}"
    stack = ("Traceback (most recent call last):\n" + "".join(traceback.format_tb(tb))
             + headline if with_traceback else f"{headline} (at {failure['where']})")
    write_error_file(path, failure, stack)
