"""The hang watchdog during a sharded persist under a real torchrun agent (`elastictrain
run`, 2 gloo ranks, examples/fsdp_resumable.py, watchdog limit 1 s). Every storage
operation is slowed by injected latency (storage faults, set by environment only):
0.4 s each keeps bytes moving on some rank more often than the limit, so the run
commits every snapshot with no exit 71; 3 s each moves nothing for longer than the
limit while the training thread waits for the persist: a hang, exit 71."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastictrain.core.errors import EXIT_HANG
from tests.processes.sharded.test_fsdp_preempt import FsdpJob

pytestmark = pytest.mark.distributed

WATCHDOG = {"ELASTICTRAIN_WATCHDOG__TIMEOUT_S": "1",
            "ELASTICTRAIN_WATCHDOG__CHECK_INTERVAL_S": "0.1"}


def latency(seconds: float) -> str:
    return json.dumps({"latency_s": seconds})


def test_a_slow_sharded_persist_that_keeps_moving_commits_under_a_short_watchdog(
        tmp_path: Path) -> None:
    job = FsdpJob(tmp_path, ELASTICTRAIN_STORAGE__FAULTS=latency(0.4), **WATCHDOG)
    result = job.run(steps=15)  # saves 5, 10, 15: each waited for by the next one / close
    assert result.returncode == 0, result.stderr[-4000:]
    assert not job.of("watchdog.fired")
    assert all(job.committed(step) for step in (10, 15))
    waits = [e for e in job.of("snapshot.backpressure") if e["wait_s"] > 1.0]
    assert {e["rank"] for e in waits} == {0, 1}  # each rank waited longer than the limit
    assert job.final()["step"] == 15


def test_a_sharded_persist_that_moves_nothing_for_the_limit_is_a_hang(tmp_path: Path) -> None:
    job = FsdpJob(tmp_path, ELASTICTRAIN_STORAGE__FAULTS=latency(3.0), **WATCHDOG)
    result = job.run(steps=15)
    assert result.returncode != 0
    fired = job.of("watchdog.fired")
    assert fired and all(e["timeout_s"] == 1.0 for e in fired)
    assert any(e["exit_code"] == EXIT_HANG for e in job.of("agent.worker_failed"))
    assert not job.committed(15)
