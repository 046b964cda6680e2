"""Every place elastictrain reaches into torch's launcher beyond its public API.

torchrun has no hook for the agent class, for the process starter or for the question
"does a node wait to join?", and its agent keeps the running workers' processes in
private fields. Each such reach is here, and only here, so that a torch upgrade has one
file to check. ``CHECKED_TORCH`` names the torch versions the hooks were checked
against; ``tests/unit/launcher/test_torch_hooks.py`` fails on any other version, and when
torch moves what a hook replaces or reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed.elastic.agent.server.local_elastic_agent as local_agent
import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from elastictrain.core.errors import ElasticTrainError

CHECKED_TORCH = ("2.13", "2.14")


@contextmanager
def agent_built_by(build: Callable[..., LocalElasticAgent]) -> Iterator[None]:
    """While inside, torchrun's ``launch_agent`` builds its agent with ``build`` (it
    calls ``LocalElasticAgent(...)`` by its module-level name, with keyword arguments)."""
    original = getattr(launcher_api, "LocalElasticAgent", None)
    if original is not LocalElasticAgent:
        raise ElasticTrainError(
            "torch.distributed.launcher.api no longer builds LocalElasticAgent by name; "
            "fix: run plain torchrun (no agent events; exit 1 instead of 75 on preemption) "
            "and report the torch version")
    launcher_api.LocalElasticAgent = build  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original  # type: ignore[misc]


@contextmanager
def workers_started_by(make_start: Callable[[Callable[..., Any]], Callable[..., Any]]
                       ) -> Iterator[None]:
    """While inside, the local agent's ``_start_workers`` starts its processes with
    ``make_start(original)`` (it calls the module-level ``start_processes``)."""
    original = local_agent.start_processes
    local_agent.start_processes = make_start(original)
    try:
        yield
    finally:
        local_agent.start_processes = original


def answer_nodes_waiting(handler: Any, answer: Callable[[Callable[[], int]], int]) -> None:
    """torchrun's monitor loop asks the rendezvous handler's ``num_nodes_waiting()``
    (no agent step to override): ``answer(ask)`` answers instead, ``ask`` being the
    handler's own."""
    ask = handler.num_nodes_waiting
    handler.num_nodes_waiting = lambda: answer(ask)


def process_context(agent: LocalElasticAgent) -> Any | None:
    """The running workers' process context (``PContext``), None before a start."""
    return getattr(agent, "_pcontext", None)


def subprocess_handlers(agent: LocalElasticAgent) -> dict[int, Any]:
    """local rank -> the running workers' process handlers (each has ``proc``)."""
    return getattr(process_context(agent), "subprocess_handlers", None) or {}


def error_files(agent: LocalElasticAgent) -> dict[int, str]:
    """local rank -> the error file torch's ``@record`` writes in the worker."""
    return getattr(process_context(agent), "error_files", None) or {}


def stderr_files(agent: LocalElasticAgent) -> dict[int, Any]:
    """local rank -> the worker's stderr log file (none when not redirected)."""
    found = getattr(process_context(agent), "stderrs", None) or {}
    return found if isinstance(found, dict) else {}


def handler_store(rdzv_handler: Any) -> Any | None:
    """The store behind torch's dynamic rendezvous handler (None for another handler)."""
    return getattr(rdzv_handler, "_store", None)


def this_node(rdzv_handler: Any) -> Any | None:
    """This launcher's node in torch's dynamic rendezvous (``addr``, ``pid``,
    ``local_id``; None for another handler)."""
    return getattr(rdzv_handler, "_this_node", None)


def remaining_restarts(agent: LocalElasticAgent) -> int:
    return int(agent._remaining_restarts)


def rendezvous_store(agent: LocalElasticAgent) -> Any:
    """The store of the current rendezvous round (for the exit barrier)."""
    return agent._store


def exit_barrier_timeout(agent: LocalElasticAgent) -> float:
    return float(agent._exit_barrier_timeout)
