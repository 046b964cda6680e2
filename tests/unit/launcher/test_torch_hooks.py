"""Each reach into torch's launcher (launcher/torch_hooks.py) still finds what it
replaces or reads in the installed torch: a torch that moved any of them fails here,
not in a user's run."""

from __future__ import annotations

import inspect

import torch
import torch.distributed.elastic.agent.server.api as agent_api
import torch.distributed.elastic.agent.server.local_elastic_agent as local_agent
import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from elastictrain.launcher import torch_hooks


def test_the_installed_torch_is_one_the_hooks_were_checked_against() -> None:
    version = ".".join(torch.__version__.split(".")[:2])
    assert version in torch_hooks.CHECKED_TORCH, (
        f"torch {torch.__version__}: check every hook in launcher/torch_hooks.py against "
        "it, then add it to CHECKED_TORCH")


def test_torchrun_builds_its_agent_by_the_name_the_hook_replaces() -> None:
    assert launcher_api.LocalElasticAgent is local_agent.LocalElasticAgent
    assert "LocalElasticAgent(" in inspect.getsource(launcher_api.launch_agent)
    built = []
    with torch_hooks.agent_built_by(lambda **kwargs: built.append(kwargs)):  # type: ignore[arg-type]
        launcher_api.LocalElasticAgent(spec="s")  # type: ignore[arg-type,call-arg]
    assert built == [{"spec": "s"}]
    assert launcher_api.LocalElasticAgent is local_agent.LocalElasticAgent


def test_the_local_agent_starts_workers_through_the_name_the_hook_replaces() -> None:
    source = inspect.getsource(local_agent.LocalElasticAgent._start_workers)
    assert "start_processes(" in source and "self._pcontext" in source
    original = local_agent.start_processes
    with torch_hooks.workers_started_by(lambda start: lambda **kw: ("ours", start)):
        assert local_agent.start_processes() == ("ours", original)  # type: ignore[call-arg]
    assert local_agent.start_processes is original


def test_the_monitor_loop_asks_the_handler_whether_nodes_wait() -> None:
    assert "num_nodes_waiting()" in inspect.getsource(agent_api.SimpleElasticAgent._invoke_run)
    assert callable(DynamicRendezvousHandler.num_nodes_waiting)

    class Handler:
        def num_nodes_waiting(self) -> int:
            return 2

    handler = Handler()
    torch_hooks.answer_nodes_waiting(handler, lambda ask: ask() + 1)
    assert handler.num_nodes_waiting() == 3


def test_the_private_fields_read_are_still_set() -> None:
    handler_init = inspect.getsource(DynamicRendezvousHandler.__init__)
    assert "self._store" in handler_init and "self._this_node" in handler_init
    simple = inspect.getsource(agent_api.SimpleElasticAgent.__init__)
    for name in ("self._remaining_restarts", "self._exit_barrier_timeout",
                 "self._worker_group"):
        assert name in simple, name
    assert "self._store" in inspect.getsource(agent_api.SimpleElasticAgent._rendezvous)
    assert "self._pcontext" in inspect.getsource(local_agent.LocalElasticAgent.__init__)
    context = inspect.getsource(PContext.__init__)
    for name in ("self.error_files", "self.stderrs"):
        assert name in context, name
    assert "self.subprocess_handlers" in inspect.getsource(
        torch.distributed.elastic.multiprocessing.api.SubprocessContext._start)
