"""``init()`` / ``shutdown()``: the two calls around a training script.

``init`` reads the worker environment once, configures structured logging
with the run's context bound (run_id, rank, world_size, restart_count), and
joins the process group. ``shutdown`` destroys the group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from elastictrain import events, preempt, watchdog
from elastictrain import log as et_log
from elastictrain.config import Settings, load_settings
from elastictrain.dist import DistContext, destroy_process_group, init_process_group
from elastictrain.env import WorkerEnv


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
    ctx = init_process_group(settings.dist, env)
    et_log.bind(rank=ctx.rank, world_size=ctx.world_size)
    # A notice from here on is acted on at the first step boundary; until that first
    # step the watchdog allows startup_timeout_s. One file/URL poller per node is enough.
    preempt.install(settings.preempt, poll=env.local_rank == 0)
    watchdog.install(settings.watchdog)
    return Runtime(settings, env, ctx, str(sink.path.parent))


def shutdown() -> None:
    """Leave the process group (call at the end of training, also on errors)."""
    watchdog.uninstall()  # teardown is not a hang
    # Handlers stay: a late SIGTERM from the agent must not turn exit 75 into a kill.
    preempt.uninstall(restore_signals=False)
    destroy_process_group()

