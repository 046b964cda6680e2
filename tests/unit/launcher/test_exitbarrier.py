"""The exit barrier on a real TCPStore, with the rendezvous's liveness given."""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
from torch.distributed import DistStoreError, TCPStore

from elastictrain.launcher import exitbarrier
from elastictrain.launcher.agent import ElasticTrainAgent
from elastictrain.launcher.exitbarrier import exit_barrier, job_finished, mark_job_finished


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exitbarrier, "POLL_S", 0.01)
    monkeypatch.setattr(exitbarrier, "LIVENESS_EVERY_S", 0.05)


def test_every_agent_arriving_ends_the_wait(store: TCPStore) -> None:
    other = threading.Thread(target=exit_barrier, args=(store, 2, 30, lambda: 2))
    other.start()
    outcome = exit_barrier(store, 2, 30, lambda: 2)
    other.join(timeout=30)
    assert outcome.ended == "all" and not other.is_alive()


def test_an_agent_gone_from_the_rendezvous_is_not_waited_for(store: TCPStore) -> None:
    outcome = exit_barrier(store, 2, 30, lambda: 1)
    assert (outcome.ended, outcome.arrived, outcome.live) == ("gone", 1, 1)


def test_a_live_agent_that_has_not_arrived_is_waited_for(store: TCPStore) -> None:
    # Three in the round, one lost, one alive and still busy: no early end.
    with pytest.raises(DistStoreError, match="1 of 3 agents arrived"):
        exit_barrier(store, 3, 0.5, lambda: 2)


def test_unknown_liveness_waits_as_torchrun_does(store: TCPStore) -> None:
    with pytest.raises(DistStoreError):
        exit_barrier(store, 2, 0.3, lambda: None)


def test_a_late_agent_counted_dead_passes_alone(store: TCPStore) -> None:
    """Declared gone while busy, the late agent completes the count when it arrives."""
    assert exit_barrier(store, 2, 30, lambda: 1).ended == "gone"
    assert exit_barrier(store, 2, 30, lambda: 2).ended == "all"


def test_the_finished_record_is_per_job(store: TCPStore) -> None:
    ours = SimpleNamespace(_store=store, get_run_id=lambda: "job-a")
    other = SimpleNamespace(_store=store, get_run_id=lambda: "job-b")
    assert not job_finished(ours)
    mark_job_finished(ours)
    assert job_finished(ours) and not job_finished(other)
    assert not job_finished(SimpleNamespace(get_run_id=lambda: "x"))  # no store: cannot tell


def test_a_waiting_node_that_read_the_closed_rendezvous_is_not_stayed_for(
        store: TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its wait-list entry outlives it until its keep-alive expires (20 s and more):
    once it recorded that it read the closure, the launchers staying for it go."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    newcomer, other = _NodeDesc("10.0.0.9", 41, 0), _NodeDesc("10.0.0.8", 42, 0)
    state = SimpleNamespace(wait_list={newcomer, other}, redundancy_list=set())
    monkeypatch.setattr(exitbarrier, "_read_state", lambda _handler: state)
    host = SimpleNamespace(_store=store, get_run_id=lambda: "job-a")
    assert exitbarrier.nodes_waiting(host) == 2
    agent = _agent_of(SimpleNamespace(_store=store, get_run_id=lambda: "job-a",
                                      _this_node=newcomer))
    assert agent.joined_closed_rendezvous() == 1  # nobody recorded a finished run here
    assert exitbarrier.nodes_waiting(host) == 1
    state.wait_list.discard(other)
    assert exitbarrier.stay_for_waiting_nodes(host, timeout_s=30) < 5


def _agent_of(handler: object) -> ElasticTrainAgent:
    agent = ElasticTrainAgent.__new__(ElasticTrainAgent)  # only what these methods read
    agent._worker_group = SimpleNamespace(spec=SimpleNamespace(rdzv_handler=handler))  # type: ignore[assignment]
    agent.rendezvous_error = None
    return agent


def test_a_node_finding_the_rendezvous_closed_after_a_finished_run_exits_0(
        store: TCPStore) -> None:
    handler = SimpleNamespace(_store=store, get_run_id=lambda: "job-a")
    mark_job_finished(handler)
    agent = _agent_of(handler)
    assert agent.joined_closed_rendezvous() == 0 and agent.rendezvous_error is None


def test_a_node_finding_the_rendezvous_closed_otherwise_fails_and_says_why(
        store: TCPStore) -> None:
    agent = _agent_of(SimpleNamespace(_store=store, get_run_id=lambda: "job-a"))
    assert agent.joined_closed_rendezvous() == 1
    assert agent.rendezvous_error is not None
    assert "rendezvous is closed" in agent.rendezvous_error and "fix:" in agent.rendezvous_error


def test_the_launcher_summary_says_the_rendezvous_ended_it(
        store: TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    from elastictrain.launcher.exits import failure_summary, launch_meaning

    agent = _agent_of(SimpleNamespace(_store=store, get_run_id=lambda: "job-a"))
    assert "restarts are used up" in launch_meaning(1, agent)  # no rendezvous error
    assert agent.joined_closed_rendezvous() == 1
    assert launch_meaning(1, agent) == "failed in the rendezvous, not in the workers"
    assert failure_summary(agent) == [agent.rendezvous_error]
