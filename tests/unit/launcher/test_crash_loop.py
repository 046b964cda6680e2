"""The agent's crash-loop rule and the failure summary lines: identical first failures
(same error, place and step) in a row stop the run; progress or another error does not."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from elastictrain.launcher.agent import ElasticTrainAgent, WorkersFatal
from elastictrain.launcher.agent_settings import AgentSettings
from elastictrain.launcher.policy import CrashLoop
from elastictrain.runlog.failure import failure_lines


def _agent(limit: int) -> ElasticTrainAgent:
    agent = ElasticTrainAgent.__new__(ElasticTrainAgent)
    agent.settings = AgentSettings(crash_loop_failures=limit)
    agent.outcome = None
    agent.failure = None
    agent._crash_loop = CrashLoop(limit)
    agent._killed = set()
    agent._pcontext = None  # type: ignore[assignment]
    return agent


def _error(step: int, message: str = "Numpy is not available") -> dict[str, Any]:
    return {"error": "RuntimeError", "message": message, "where": "onepass.py:282",
            "failed_step": step, "worker_rank": 0, "log_file": "ev/attempt000-x-rank0.jsonl"}


class _Failure:
    """A worker's failure as torchrun reports it (ProcessFailure), with its error file."""

    def __init__(self, error: dict[str, Any] | None) -> None:
        self.pid, self.local_rank, self.exitcode, self.message = 4242, 0, 1, "failed"
        self.error_file_data = {"elastictrain": error} if error is not None else {}

    def signal_name(self) -> str:
        return ""


def _fail(agent: ElasticTrainAgent, error: dict[str, Any] | None) -> None:
    agent._on_failures({0: _Failure(error)})  # type: ignore[dict-item]


def test_two_identical_failures_stop_the_run() -> None:
    agent = _agent(2)
    _fail(agent, _error(0))
    with capture_logs() as logs, pytest.raises(WorkersFatal, match="crash loop"):
        _fail(agent, _error(0))
    assert agent.outcome == "crash_loop"
    assert [(e["event"], e["failures"], e["where"]) for e in logs
            if e["event"] == "agent.crash_loop"] == [("agent.crash_loop", 2, "onepass.py:282")]


@pytest.mark.parametrize("second", [_error(12), _error(0, "another message"), None])
def test_progress_another_error_or_a_signal_starts_over(second: dict[str, Any] | None) -> None:
    agent = _agent(2)
    _fail(agent, _error(0))
    _fail(agent, second)  # a later step, another error, a SIGKILL: retried
    assert agent.outcome is None
    if second is not None:  # it is now the one that must repeat
        with pytest.raises(WorkersFatal):
            _fail(agent, dict(second))


def test_node_losses_at_one_step_are_no_crash_loop() -> None:
    """Two nodes lost in a row at the same step: the survivor raises the same
    PeerNodeLost twice; the fleet failed, not the script."""
    agent = _agent(2)
    lost = {**_error(15), "error": "PeerNodeLost",
            "message": "rank(s) [1] of another node sent no record of step 15 before its "
            "optimizer step: its connection ended; the node is taken as lost"}
    for _ in range(3):
        _fail(agent, dict(lost))
    assert agent.outcome is None


def test_zero_never_stops() -> None:
    agent = _agent(0)
    for _ in range(5):
        _fail(agent, _error(0))
    assert agent.outcome is None


def test_summary_lines_name_the_error_place_log_and_fix() -> None:
    lines = "\n".join(failure_lines({**_error(3), "output_file": "logs/0/stderr.log"}, 2))
    assert "error:           RuntimeError: Numpy is not available" in lines
    assert "raised at:     onepass.py:282 (rank 0, step 3)" in lines
    assert "logs/0/stderr.log" in lines and "ev/attempt000-x-rank0.jsonl" in lines
    assert "crash loop" in lines and "fix:" in lines
    own_fix = failure_lines({"error": "ConfigError", "message": "snapshot.keep=0; fix: "
                             "set it >= 1", "where": "x.py:1", "worker_rank": 1})
    assert own_fix[-1].endswith("fix:             set it >= 1")
    assert failure_lines(None) == []


def test_the_demo_summary_names_the_first_failing_workers_error(tmp_path: Any) -> None:
    import json

    from elastictrain.demo.runner import human_summary, summarize

    events = [{"event": "agent.worker_failed", "ts": 2.0, "first": False, "worker_rank": 1,
               "message": "RuntimeError: peer"},
              {"event": "agent.worker_failed", "ts": 2.1, "first": True,
               **_error(0), "message": "RuntimeError: Numpy is not available"},
              {"event": "agent.crash_loop", "ts": 2.2, "failures": 2}]
    (tmp_path / "agent-x-host-1.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in events))
    result = summarize(str(tmp_path), "store", 78, 1.0)
    text = human_summary(result)
    assert "error:           RuntimeError: Numpy is not available" in text
    assert "raised at:     onepass.py:282 (rank 0, step 0)" in text
    assert "crash loop:      the same error at the same step in 2 attempts" in text
    assert "fix:" in text
