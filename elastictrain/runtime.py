"""``init()`` / ``shutdown()``: the two calls around a training script.

``init`` reads the worker environment once, configures structured logging
with the run's context bound (run_id, rank, world_size, restart_count), joins
the process group, and installs a ``sys.excepthook`` under which an
:class:`~elastictrain.errors.ElasticTrainError` reaching the top of the script
logs one ``worker.error`` event and exits with the error's ``exit_code`` (78 for
a fatal one: the launcher's agent then stops restarting). What it returns is
also ``current()``, where a ``SnapshotManager`` built without ``ctx``/``config``
finds it. ``shutdown`` destroys the group and restores the previous hook.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from elastictrain import events, preempt, watchdog
from elastictrain import log as et_log
from elastictrain.config import Settings, load_settings
from elastictrain.dist import DistContext, destroy_process_group, init_process_group
from elastictrain.env import WorkerEnv
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

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def device(self) -> Any:
        return self.ctx.device


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
    _current = Runtime(settings, env, ctx, str(sink.path.parent))
    return _current


def current() -> Runtime | None:
    """What ``init`` returned in this process (None before ``init`` or after ``shutdown``)."""
    return _current


def shutdown() -> None:
    """Leave the process group (call at the end of training, also on errors)."""
    failing = sys.exc_info()[1]
    if failing is not None:  # from a ``finally`` while an error propagates: the rescue
        rescue.on_uncaught(failing)  # goes first, before the agent stops this process
    watchdog.uninstall()  # teardown is not a hang
    # Handlers stay: a late SIGTERM from the agent must not turn exit 75 into a kill.
    preempt.uninstall(restore_signals=False)
    destroy_process_group()
    global _current
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
    if not isinstance(exc, ElasticTrainError):
        (_previous_hook or sys.__excepthook__)(exc_type, exc, tb)
        return
    frames = traceback.extract_tb(tb)
    et_log.get_logger("elastictrain").error(
        "worker.error", error=exc_type.__name__, message=str(exc), exit_code=exc.exit_code,
        fatal=exc.exit_code == EXIT_FATAL,
        where=f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None)
    raise SystemExit(exc.exit_code)


_current: Runtime | None = None

