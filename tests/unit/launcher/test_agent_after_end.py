"""A worker that exits with an error after every rank agreed the run's end fails no
run, however its exit falls between the agent's reads: before its own check, or between
that check and torchrun's (a race seen 1 in 6 under load, which restarted a finished
run). torch's monitor is replaced by a stand-in (unit test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elastictrain.launcher.agent import ElasticTrainAgent
from elastictrain.launcher.agent_settings import AgentSettings

PID = 4242


class _Group:
    class _Worker:
        global_rank = 1

    workers = [_Worker()]


def _agent(tmp_path: Path, reads: list[int | None]) -> tuple[ElasticTrainAgent, list[Any]]:
    """An agent whose one worker reads as running, then as exited with ``reads``' codes
    (the last one repeats), past the agreed end (its mark written)."""
    (tmp_path / f"ended-{PID}").touch()
    agent = ElasticTrainAgent.__new__(ElasticTrainAgent)
    agent.settings = AgentSettings(end_dir=tmp_path)
    agent._end_logged = agent._finished = agent._detected = False
    agent._killed = set()
    agent._pcontext = None
    handled: list[Any] = []
    agent._kill_stuck_at_exit = lambda: None  # type: ignore[method-assign]
    agent._set_aside_torn_error_files = lambda: None  # type: ignore[method-assign]
    agent._on_failures = handled.append  # type: ignore[method-assign,assignment]
    left = list(reads)

    def codes() -> dict[int, int | None]:
        return {PID: left.pop(0) if len(left) > 1 else left[0]}

    agent._worker_codes = codes  # type: ignore[method-assign]
    return agent, handled


def _torch_sees_exit_3(monkeypatch: pytest.MonkeyPatch) -> None:
    failure = ProcessFailure(local_rank=0, pid=PID, exitcode=3, error_file="")

    def monitor(self: Any, worker_group: Any) -> RunResult:
        return RunResult(state=WorkerState.FAILED, failures={1: failure})

    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", monitor)


@pytest.mark.parametrize("running_reads", [0, 1, 2])
def test_an_exit_past_the_end_is_no_failure_whenever_it_is_seen(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, running_reads: int) -> None:
    """``running_reads``: how many of the agent's own reads still see the worker run
    before it exits 3 (2: only torchrun's read sees the exit)."""
    _torch_sees_exit_3(monkeypatch)
    agent, handled = _agent(tmp_path, [None] * running_reads + [3])
    with capture_logs() as logs:
        result = agent._monitor_workers(_Group())  # type: ignore[arg-type]
    assert result.state == WorkerState.SUCCEEDED
    assert handled == []  # no failure handled, so no restart
    assert [e["exit_codes"] for e in logs
            if e["event"] == "agent.failed_after_end"] == [{str(PID): 3}]
    assert not [e for e in logs if e["event"] == "agent.failure_detected"]


def test_an_exit_before_the_end_is_a_failure(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _torch_sees_exit_3(monkeypatch)
    agent, handled = _agent(tmp_path, [3])
    (tmp_path / f"ended-{PID}").unlink()
    result = agent._monitor_workers(_Group())  # type: ignore[arg-type]
    assert result.state == WorkerState.FAILED and len(handled) == 1
