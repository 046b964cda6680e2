"""Faults in combination under a real torchrun agent (`elastictrain run`, 2 gloo workers,
SIGTERM by PID to the launcher, which forwards it): a preemption notice while the store
fails (exit 76, `preempt.failed` on every rank, a relaunch resumes from the newest
committed snapshot), and a slow-but-moving upload under a 1 s hang watchdog (the final
snapshot commits, exit 75; the end-of-run close waits for its slow upload, exit 0)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from elastictrain.core.errors import EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED
from tests.helpers import FAULTS_JOB_OPTIONS, TRAIN_JOB, wait_for
from tests.processes.e2e.test_preemption import LAUNCH_TIMEOUT, Job, assert_preempted_unsaved

pytestmark = pytest.mark.distributed

JOB = TRAIN_JOB


class FaultsJob(Job):
    """tests/train_job.py under `elastictrain run`, configured by environment only."""

    entrypoint = JOB.name

    def argv(self, steps: int, *extra: str) -> list[str]:
        return ["--nproc-per-node=2", "--max-restarts=0", f"--log-dir={self.tmp / 'logs'}",
                str(JOB), str(self.storage), str(steps), *FAULTS_JOB_OPTIONS, *extra]

    def resumed_from(self) -> int:
        resume = [e for e in self.of("resume", rank=0) if e.get("from_step") is not None]
        return int(resume[-1]["from_step"])


def test_notice_while_the_store_fails_exits_76_and_a_relaunch_resumes(tmp_path: Path) -> None:
    switch = tmp_path / "fail-switch"
    job = FaultsJob(tmp_path, FAULTS_JOB_FAIL_WHILE=str(switch), FAULTS_JOB_STEP_S="0.02",
                    ELASTICTRAIN_SNAPSHOT__EVERY_STEPS="50",
                    ELASTICTRAIN_SNAPSHOT__RETRY_BACKOFF_S="2",
                    ELASTICTRAIN_SNAPSHOT__MAX_CONSECUTIVE_FAILURES="3")
    with job.start(steps=100_000) as launcher:
        wait_for(lambda: job.committed(50), 180, "the first periodic snapshot")
        switch.touch()
        wait_for(lambda: job.of("snapshot.failed"), 120, "a save to fail and be retried")
        os.kill(launcher.pid, signal.SIGTERM)
        code = launcher.wait(timeout=LAUNCH_TIMEOUT)
    step = assert_preempted_unsaved(job, code, "injected failure")
    assert not job.of("preempt.saved") and not job.committed(step)
    attempted = {e["snapshot_step"] for e in job.of("snapshot.failed")}
    assert step in attempted  # the final snapshot was attempted, not skipped
    assert job.of("preempt.inflight_failed", rank=0)
    finished = job.of("agent.finished")
    assert finished[-1]["exit_code"] == EXIT_PREEMPTED_UNSAVED
    assert finished[-1]["outcome"] == "preempted_unsaved"
    newest = job.newest()
    assert newest < step
    switch.unlink()
    result = job.run(steps=newest + 5)
    assert result.returncode == 0, result.stderr[-4000:]
    assert job.resumed_from() == newest
    assert job.of("run.finished")[-1]["final_step"] == newest + 5


def test_slow_moving_final_upload_under_a_short_watchdog_commits_and_exits_75(
        tmp_path: Path) -> None:
    # 4 MB of state at 64 KiB per 50 ms: each save uploads for about 3 s, three times the
    # watchdog's 1 s limit, and never stops moving for longer than about 0.4 s.
    job = FaultsJob(tmp_path, FAULTS_JOB_TRICKLE=f"{64 << 10}:0.05", FAULTS_JOB_STEP_S="0.02",
                    ELASTICTRAIN_SNAPSHOT__EVERY_STEPS="50",
                    ELASTICTRAIN_WATCHDOG__TIMEOUT_S="1",
                    ELASTICTRAIN_WATCHDOG__CHECK_INTERVAL_S="0.1")
    with job.start(steps=100_000) as launcher:
        wait_for(lambda: job.committed(50), 180, "the first periodic snapshot")
        os.kill(launcher.pid, signal.SIGTERM)
        code = launcher.wait(timeout=LAUNCH_TIMEOUT)
    assert code == EXIT_PREEMPTED, job.log()
    saved = job.of("preempt.saved")
    assert {e["rank"] for e in saved} == {0, 1}
    step = saved[0]["snapshot_step"]
    assert job.committed(step) and job.newest() == step
    assert saved[0]["save_s"] > 1.0  # the final upload outlasted the watchdog's limit
    assert not job.of("watchdog.fired")
    result = job.run(steps=step + 3)  # ends with a final save: close() waits ~3 s for it
    assert result.returncode == 0, result.stderr[-4000:]
    assert job.resumed_from() == step  # nothing lost
    assert job.committed(step + 3) and not job.of("watchdog.fired")
