"""A worker stuck in its exit after its peer finished (chaos found it: a SIGSTOP that
landed after ``run.finished``). torchrun's agent waits for a live worker without
bound, so the run never ended; elastictrain's agent kills a worker that uses no CPU
for ``launch.exit_timeout_s`` once a peer exited 0. Every rank had agreed the run's
end in ``close()``, so the run is finished: no restart re-runs its end (a restart would
resume from an older durable snapshot once the finished run removed its memory copy).
A worker that is busy for longer than that (a long final write) is left alone."""

from __future__ import annotations

import os
import signal
import sys
from contextlib import suppress
from pathlib import Path

import pytest

from tests.helpers import REPO, TRAIN_JOB, events, pid_alive, started, wait_for

pytestmark = pytest.mark.distributed

JOB = str(TRAIN_JOB)
EXIT_TIMEOUT_S = 4.0
NOTICE_GRACE_S = 5


def run_job(tmp_path: Path, mode: str, busy_s: float) -> tuple[int, Path, str]:
    """The launcher to completion; its log, not a pipe (a stuck worker would hold a
    pipe open past the launcher's end)."""
    ev = tmp_path / "ev"
    cmd = [sys.executable, "-m", "elastictrain.cli", "run", "--nproc-per-node=2",
           "--max-restarts=2", f"--log-dir={tmp_path / 'logs'}", JOB, str(tmp_path / "s"),
           "10", "--every=5", f"--exit-stall={mode}", f"--busy-s={busy_s}"]
    try:
        with started(cmd, tmp_path, "launcher.log", ELASTICTRAIN_LOG__EVENTS_DIR=str(ev),
                     ELASTICTRAIN_LAUNCH__EXIT_TIMEOUT_S=str(EXIT_TIMEOUT_S),
                     PYTHONPATH=str(REPO)) as launcher:
            code = launcher.wait(timeout=240)
    finally:  # before the fix the stopped worker outlived the launcher's timeout
        for start in events(ev, "worker.start"):
            with suppress(ProcessLookupError):
                os.kill(int(start["pid"]), signal.SIGKILL)
    return code, ev, (tmp_path / "launcher.log").read_text()


def test_a_worker_stopped_in_its_exit_is_killed_and_the_run_finishes(tmp_path: Path) -> None:
    code, ev, log = run_job(tmp_path, "stop", 0)
    assert code == 0, log[-4000:]
    stuck = events(ev, "agent.worker_stuck_at_exit")
    assert len(stuck) == 1 and len(stuck[0]["pids"]) == 1
    rank0_first = next(e for e in events(ev, "worker.start") if e["rank"] == 0)
    assert stuck[0]["pids"] == [rank0_first["pid"]]
    assert not pid_alive(rank0_first["pid"])
    assert stuck[0]["exit_codes"][str(rank0_first["pid"])] is None
    assert 0 in stuck[0]["exit_codes"].values()  # its peer had finished
    (after_end,) = events(ev, "agent.failed_after_end")
    assert after_end["exit_codes"] == {str(rank0_first["pid"]): -signal.SIGKILL}
    assert events(ev, "agent.restart") == []  # the run had ended: nothing to re-run
    assert len(events(ev, "agent.attempt_started")) == 1
    assert len(events(ev, "params.digest")) == 1


def test_a_busy_exit_longer_than_the_timeout_is_left_to_finish(tmp_path: Path) -> None:
    code, ev, log = run_job(tmp_path, "busy", 3 * EXIT_TIMEOUT_S)
    assert code == 0, log[-4000:]
    assert not events(ev, "agent.worker_stuck_at_exit")
    assert not events(ev, "agent.restart")
    assert len(events(ev, "agent.attempt_started")) == 1


def test_a_notice_after_the_agreed_end_leaves_a_finished_run(tmp_path: Path) -> None:
    """SIGTERM to the launcher (a scheduler's notice) while rank 0 still works after
    ``close()``: every rank had agreed the end, so the launcher exits 0, not 143 (a
    relaunch would re-run the end from an older snapshot)."""
    ev = tmp_path / "ev"
    cmd = [sys.executable, "-m", "elastictrain.cli", "run", "--nproc-per-node=2",
           "--max-restarts=2", f"--log-dir={tmp_path / 'logs'}", JOB, str(tmp_path / "s"),
           "10", "--every=5", "--exit-stall=busy", "--busy-s=600"]
    try:
        # Rank 0 stays busy past the notice's grace: a short grace keeps the test short.
        with started(cmd, tmp_path, "launcher.log", ELASTICTRAIN_LOG__EVENTS_DIR=str(ev),
                     ELASTICTRAIN_LAUNCH__SHUTDOWN_TIMEOUT_S=str(NOTICE_GRACE_S),
                     PYTHONPATH=str(REPO)) as launcher:
            wait_for(lambda: bool(events(ev, "run.finished")) and _rank1_gone(ev), 180,
                     "the run's end, rank 0 still busy after it")
            launcher.send_signal(signal.SIGTERM)
            code = launcher.wait(timeout=120)
    finally:
        for start in events(ev, "worker.start"):
            with suppress(ProcessLookupError):
                os.kill(int(start["pid"]), signal.SIGKILL)
    log = (tmp_path / "launcher.log").read_text()
    assert code == 0, log[-4000:]
    (finished,) = events(ev, "agent.finished")
    assert finished["exit_code"] == 0
    assert events(ev, "agent.restart") == []


def _rank1_gone(ev: Path) -> bool:
    """Rank 1 returned from its script (rank 0 is still busy after close())."""
    rank1 = [e for e in events(ev, "worker.start") if e["rank"] == 1]
    return bool(rank1) and not pid_alive(int(rank1[0]["pid"]))
