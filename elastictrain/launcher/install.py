"""The agent in the launcher process: torchrun's ``launch_agent`` builds
:class:`~elastictrain.launcher.agent.ElasticTrainAgent` (``installed``), and the grace
watch asks it what to kill and which code to exit with (``on_grace_expired``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from elastictrain.core.errors import EXIT_OK
from elastictrain.launcher import torch_hooks
from elastictrain.launcher.agent import ElasticTrainAgent
from elastictrain.launcher.agent_settings import AgentSettings
from elastictrain.launcher.policy import signalled_exit_code


def on_grace_expired(agent: ElasticTrainAgent | None, signum: int) -> tuple[list[int], int]:
    """For ``gracewatch``: the process groups to SIGKILL (the current workers, each in
    its own session, and the standby) and the launcher's exit code: 75/76 when the
    workers settled their final snapshot, else that of a launcher killed by ``signum``."""
    if agent is None:
        return [], 128 + signum
    workers = agent._workers()
    groups = workers.running
    if agent.standby is not None and agent.standby.pid is not None:
        groups.append(agent.standby.pid)
    if agent.finished:  # stuck in the exit barrier, waiting for the other nodes
        return groups, EXIT_OK
    return groups, signalled_exit_code(workers, agent.outcome, signum)


class Built:
    """The agent torchrun built in this launcher (None until the first rendezvous),
    handed to the launcher by :func:`installed`, for its exit code and summary."""

    def __init__(self) -> None:
        self.agent: ElasticTrainAgent | None = None


@contextmanager
def installed(settings: AgentSettings | None = None) -> Iterator[Built]:
    """Make torchrun's ``launch_agent`` build :class:`ElasticTrainAgent` with
    ``settings`` (this process, for the duration of the run); the agent it built is
    then in the :class:`Built` yielded."""
    settings = settings or AgentSettings()
    built = Built()

    def build(*args: Any, **kwargs: Any) -> ElasticTrainAgent:
        built.agent = ElasticTrainAgent(settings, *args, **kwargs)
        return built.agent

    try:
        with torch_hooks.agent_built_by(build):
            yield built
    finally:
        if built.agent is not None:
            built.agent.close_standby()
