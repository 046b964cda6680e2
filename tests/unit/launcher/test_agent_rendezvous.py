"""The agent's rendezvous: a rank exchange that times out (a node lost right after its
round closed) joins the next round instead of failing the launcher, a bounded number
of times. torch's rendezvous is replaced by a stand-in (unit test)."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs
from torch.distributed import DistStoreError
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from elastictrain.launcher.agent import RENDEZVOUS_RETRIES, ElasticTrainAgent


class _Group:
    workers: list[Any] = []
    group_world_size = 1


def _agent() -> ElasticTrainAgent:
    agent = ElasticTrainAgent.__new__(ElasticTrainAgent)
    agent._world_size = None
    return agent


def _rendezvous_failing(times: int) -> tuple[list[int], Any]:
    calls: list[int] = []

    def fake(self: Any, worker_group: Any) -> None:
        calls.append(1)
        if len(calls) <= times:
            raise DistStoreError("wait timeout after 60000ms, keys: .../role_info/1")

    return calls, fake


def test_a_timed_out_rank_exchange_joins_the_next_round(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls, fake = _rendezvous_failing(1)
    monkeypatch.setattr(LocalElasticAgent, "_rendezvous", fake)
    with capture_logs() as logs:
        _agent()._rendezvous(_Group())  # type: ignore[arg-type]
    assert len(calls) == 2
    assert [e["retries_left"] for e in logs
            if e["event"] == "agent.rendezvous_retried"] == [RENDEZVOUS_RETRIES]


def test_it_gives_up_after_its_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, fake = _rendezvous_failing(RENDEZVOUS_RETRIES + 1)
    monkeypatch.setattr(LocalElasticAgent, "_rendezvous", fake)
    with pytest.raises(DistStoreError):
        _agent()._rendezvous(_Group())  # type: ignore[arg-type]
    assert len(calls) == RENDEZVOUS_RETRIES + 1
