"""Workers forked from the standby, end to end: `elastictrain run` (real torchrun agent),
two gloo demo workers, real SIGKILLs by PID.

A killed worker's group is forked again from the same standby and resumes from the
newest snapshot; a standby killed first leaves the next group to ``Popen`` and the run
goes on; a notice then ends either with a final snapshot (75); ``launch.standby=false``
starts no standby at all.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from elastictrain.core.errors import EXIT_PREEMPTED
from tests.helpers import pid_alive, wait_for
from tests.processes.e2e.test_preemption import Job

pytestmark = pytest.mark.distributed

STEPS = 40
# The first attempt parks after step 12, the second after step 14 (demo.multinode.Park).
GATES = ("hold:12:2:0:0", "again:14:2:1:1")


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def attempts(job: Job) -> list[dict[str, Any]]:
    return sorted(job.of("agent.attempt_started"), key=lambda e: int(e["restart_count"]))


def parked(job: Job, gate_name: str) -> dict[int, int]:
    """Once both ranks parked at the gate (and step 10 committed): rank -> pid."""
    gate = job.tmp / "park" / gate_name
    wait_for(lambda: len(list(gate.glob("rank*.json"))) == 2, 180, f"both ranks at {gate_name}")
    wait_for(lambda: job.committed(10), 180, "the snapshot of step 10")
    markers = [json.loads(p.read_text()) for p in gate.glob("rank*.json")]
    return {int(m["rank"]): int(m["pid"]) for m in markers}


def start(job: Job) -> Any:
    return job.start(STEPS, *(f"--park={g}" for g in GATES), f"--park-dir={job.tmp / 'park'}")


def stop_with_a_notice(job: Job, launcher: Any) -> None:
    """SIGTERM to the launcher: the parked workers take a final snapshot, exit 75."""
    launcher.send_signal(signal.SIGTERM)
    code = launcher.wait(timeout=240)
    assert code == EXIT_PREEMPTED, job.log()


def test_a_killed_worker_is_replaced_by_a_fork_of_the_standby(tmp_path: Path) -> None:
    job = Job(tmp_path)
    with start(job) as launcher:
        pids = parked(job, "hold")
        (ready,) = job.of("agent.standby_ready")
        standby = int(ready["pid"])
        assert ready["failed"] == {} and "torch" in ready["modules"]
        assert "s3fs" not in ready["modules"]  # a job on local disk does not import it
        assert ready["from_launcher"] is True  # forked from the launcher, not a new process
        assert {parent_of(p) for p in pids.values()} == {standby}
        os.kill(pids[1], signal.SIGKILL)
        restarted = parked(job, "again")
        assert {parent_of(p) for p in restarted.values()} == {standby}
        stop_with_a_notice(job, launcher)
    assert [a["started_by"] for a in attempts(job)] == ["standby", "standby"]
    assert not job.of("agent.standby_unavailable")
    resumed = job.of("snapshot.loaded")
    assert resumed and min(int(e["snapshot_step"]) for e in resumed) >= 10
    assert not pid_alive(standby)  # ended with the launcher


def test_a_lost_standby_leaves_the_restart_to_popen(tmp_path: Path) -> None:
    """Two faults, then a notice: the standby is SIGKILLed, then a worker. The agent sees
    the worker's end (the standby can no longer report it), restarts the group as new
    processes of its own, which resume; a notice to the launcher then ends the run
    with a final snapshot (75)."""
    job = Job(tmp_path)
    with start(job) as launcher:
        pids = parked(job, "hold")
        standby = int(job.of("agent.standby_ready")[0]["pid"])
        os.kill(standby, signal.SIGKILL)
        wait_for(lambda: not pid_alive(standby), 30, "the standby to end")
        os.kill(pids[1], signal.SIGKILL)
        restarted = parked(job, "again")
        assert {parent_of(p) for p in restarted.values()} == {launcher.pid}
        stop_with_a_notice(job, launcher)
    assert [a["started_by"] for a in attempts(job)] == ["standby", "popen"]
    (fallback,) = job.of("agent.standby_unavailable")
    assert "ended" in fallback["reason"]
    assert min(int(e["snapshot_step"]) for e in job.of("snapshot.loaded")) >= 10


def test_standby_off_starts_workers_as_new_processes(tmp_path: Path) -> None:
    job = Job(tmp_path, ELASTICTRAIN_LAUNCH__STANDBY="false")
    result = job.run(12)
    assert result.returncode == 0, result.stderr[-4000:]
    assert [a["started_by"] for a in attempts(job)] == ["popen"]
    assert not job.of("agent.standby_ready") and not job.of("agent.standby_unavailable")
