"""Preemption and hangs end to end: `elastictrain run` (real torchrun agent), gloo workers,
real signals sent by PID, a real notice file, a real HTTP metadata server on 127.0.0.1.

Each preemption test: notice mid-run → every rank agrees at the next step boundary →
a final snapshot of that step commits → the launcher exits 75 → the same command again
resumes from exactly that step (lost_steps == 0).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from elastictrain.core import layout
from elastictrain.core.errors import EXIT_HANG, EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED
from tests.helpers import REPO, events, run_cli, started, wait_for
from tests.metadata import AWS_PATH, Metadata

pytestmark = pytest.mark.distributed

LAUNCH_TIMEOUT = 240


class Job:
    """One demo job under `elastictrain run` with its storage and event dir in tmp_path."""

    # What a worker's command line names: a leftover is killed only if it is ours.
    entrypoint = "elastictrain.demo.worker"

    def __init__(self, tmp_path: Path, **env: str) -> None:
        self.tmp = tmp_path
        self.storage = tmp_path / "s"
        self.ev = tmp_path / "ev"
        self.env = {"ELASTICTRAIN_LOG__EVENTS_DIR": str(self.ev), "PYTHONPATH": str(REPO),
                    **env}

    def argv(self, steps: int, *extra: str) -> list[str]:
        return ["--nproc-per-node=2", "--max-restarts=2", f"--log-dir={self.tmp / 'logs'}",
                "-m", "elastictrain.demo.worker", f"--storage={self.storage}",
                f"--steps={steps}", "--snapshot-every=10", *extra]

    @contextmanager
    def start(self, steps: int = 5000, *extra: str) -> Iterator[subprocess.Popen[bytes]]:
        """The launcher, running; on exit kill it and, by PID, any worker it left
        behind (workers run in their own sessions)."""
        cmd = [sys.executable, "-m", "elastictrain.cli", "run", *self.argv(steps, *extra)]
        try:
            with started(cmd, self.tmp, "launcher.log", **self.env) as launcher:
                yield launcher
        finally:
            self.kill_leftovers()

    def run(self, steps: int, *extra: str) -> subprocess.CompletedProcess[str]:
        """The launcher to completion (then any worker left behind is killed by PID)."""
        try:
            return run_cli(["run", *self.argv(steps, *extra)], self.tmp, timeout=LAUNCH_TIMEOUT,
                           **self.env)
        finally:
            self.kill_leftovers()

    def kill_leftovers(self) -> None:
        """Every worker this job started that still runs, by PID (a recycled PID is
        left alone: its command line does not name the entrypoint)."""
        for event in self.of("worker.start"):
            kill_if_running(int(event["pid"]), self.entrypoint)

    def committed(self, step: int) -> bool:
        return (self.storage / layout.step_dir(step) / layout.MANIFEST).exists()

    def newest(self) -> int:
        steps = [int(p.name[5:]) for p in (self.storage / "snapshots").glob("step_*")
                 if (p / layout.MANIFEST).exists()]
        return max(steps)

    def log(self) -> str:
        return (self.tmp / "launcher.log").read_text()[-4000:]

    def of(self, name: str, rank: int | None = None) -> list[dict[str, Any]]:
        return [e for e in events(self.ev, name) if rank is None or e.get("rank") == rank]


def kill_if_running(pid: int, entrypoint: str) -> None:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return  # gone
    if entrypoint.encode() in cmdline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def assert_preempted(job: Job, code: int) -> int:
    """The launcher ended 75 after every rank saved the same step; returns that step."""
    assert code == EXIT_PREEMPTED, job.log()
    saved = job.of("preempt.saved")
    assert {e["rank"] for e in saved} == {0, 1}
    step = saved[0]["snapshot_step"]
    assert all(e["snapshot_step"] == step for e in saved)
    assert all(e["within_grace"] for e in saved)
    assert job.committed(step) and job.newest() == step
    finished = job.of("agent.finished")
    assert finished and finished[-1]["exit_code"] == EXIT_PREEMPTED
    assert not job.of("agent.restart")  # a preempted group is not restarted
    return int(step)


def assert_preempted_unsaved(job: Job, code: int, reason: str) -> int:
    """The launcher ended 76: every rank logged ``preempt.failed`` for the same step,
    with ``reason`` in the why on every rank; returns that step."""
    assert code == EXIT_PREEMPTED_UNSAVED, job.log()
    failed = job.of("preempt.failed")
    assert {e["rank"] for e in failed} == {0, 1}
    step = failed[0]["snapshot_step"]
    assert all(e["snapshot_step"] == step and e["exit_code"] == EXIT_PREEMPTED_UNSAVED
               for e in failed)
    assert all(reason in e["reason"] for e in failed)  # rank 1 has the why too
    return int(step)


def assert_resumes_without_loss(job: Job, step: int) -> None:
    result = job.run(steps=step + 3)
    assert result.returncode == 0, result.stderr[-4000:]
    resumes = [e for e in job.of("resume", rank=0) if e.get("from_step") is not None]
    assert resumes[-1]["from_step"] == step
    assert resumes[-1]["lost_steps"] == 0
    assert job.of("run.finished")[-1]["final_step"] == step + 3


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_to_the_launcher_saves_the_step_in_progress(tmp_path: Path,
                                                           sig: signal.Signals) -> None:
    job = Job(tmp_path)
    with job.start() as launcher:
        wait_for(lambda: job.committed(10), 180, "the first periodic snapshot")
        os.kill(launcher.pid, sig)
        code = launcher.wait(timeout=LAUNCH_TIMEOUT)
    step = assert_preempted(job, code)
    assert step > 10
    forwarded = job.of("agent.signal_forwarded")
    assert forwarded and forwarded[0]["signal"] == sig.name and forwarded[0]["grace_s"] == 90
    (attempt,) = job.of("agent.attempt_started")
    assert sorted(forwarded[0]["pids"]) == sorted(attempt["pids"].values())  # to both
    # Each rank logs its own notice unless its signal came after the stop was agreed
    # (the launcher signals the workers one after the other).
    notices = job.of("preempt.notice")
    assert notices and {(e["source"], e["detail"]) for e in notices} == {("signal", sig.name)}
    assert_resumes_without_loss(job, step)


def test_file_notice(tmp_path: Path) -> None:
    notice = tmp_path / "preempt-notice"
    job = Job(tmp_path, ELASTICTRAIN_PREEMPT__FILE=str(notice),
              ELASTICTRAIN_PREEMPT__POLL_INTERVAL_S="0.1")
    with job.start() as launcher:
        wait_for(lambda: job.committed(10), 180, "the first periodic snapshot")
        notice.write_text("reclaim\n")
        code = launcher.wait(timeout=LAUNCH_TIMEOUT)
    step = assert_preempted(job, code)
    # local rank 0 polls for the node; rank 1 learns it from the step's all-reduce
    assert [e["source"] for e in job.of("preempt.notice")] == ["file"]
    assert job.of("preempt.saved", rank=1)[0]["source"] == "peer"
    assert job.of("agent.preempted")
    notice.unlink()
    assert_resumes_without_loss(job, step)


def test_http_metadata_notice(tmp_path: Path) -> None:
    with Metadata() as metadata:
        job = Job(tmp_path, ELASTICTRAIN_PREEMPT__URL=metadata.base + AWS_PATH,
                  ELASTICTRAIN_PREEMPT__URL_STYLE="aws",
                  ELASTICTRAIN_PREEMPT__POLL_INTERVAL_S="0.1")
        with job.start() as launcher:
            wait_for(lambda: job.committed(10), 180, "the first periodic snapshot")
            metadata.pending = True
            code = launcher.wait(timeout=LAUNCH_TIMEOUT)
        step = assert_preempted(job, code)
        notices = job.of("preempt.notice")
        assert [e["source"] for e in notices] == ["url"] and "terminate" in notices[0]["detail"]
        metadata.pending = False
        assert_resumes_without_loss(job, step)


def test_notice_during_a_persist_commits_both_in_order(tmp_path: Path) -> None:
    """SIGUSR1 straight to rank 0 once the periodic save of step 10 is staged (its
    persist is running or just done): step 10 commits, then the final step."""
    job = Job(tmp_path)
    with job.start() as launcher:
        wait_for(lambda: any(e["snapshot_step"] == 10 for e in job.of("snapshot.staged", 0)),
                 180, "the periodic save of step 10 to be staged")
        writer = job.of("worker.start", rank=0)[0]["pid"]
        os.kill(writer, signal.SIGUSR1)
        code = launcher.wait(timeout=LAUNCH_TIMEOUT)
    step = assert_preempted(job, code)
    committed = [e["snapshot_step"] for e in job.of("snapshot.committed", rank=0)]
    assert committed[0] == 10 and committed[-1] == step and step > 10
    assert committed == sorted(set(committed))  # each once, in step order
    assert job.committed(10)
    assert job.of("preempt.notice", rank=0)[0]["detail"] == "SIGUSR1"


def test_hang_in_a_collective_is_restarted_and_finishes(tmp_path: Path) -> None:
    job = Job(tmp_path, ELASTICTRAIN_WATCHDOG__TIMEOUT_S="5",
              ELASTICTRAIN_WATCHDOG__CHECK_INTERVAL_S="0.2")
    result = job.run(40, "--hang-at=23")
    assert result.returncode == 0, result.stderr[-4000:]
    fired = job.of("watchdog.fired")
    assert fired and all(e["restart_count"] == 0 and e["last_step"] == 23 for e in fired)
    hung = [e for e in fired if e["rank"] == 1]
    if hung:  # rank 1 may also die of rank 0's exit first; where it fired, it says where
        assert any("hang_if_scheduled" in line for s in hung[0]["stacks"].values() for line in s)
    failed = job.of("agent.worker_failed")
    assert any(e["exit_code"] == EXIT_HANG for e in failed)
    assert [e["reason"] for e in job.of("agent.restart")] == ["failure"]
    resumed = [e for e in job.of("resume", rank=0) if e["restart_count"] == 1]
    assert resumed and resumed[0]["from_step"] == 20
    assert job.of("run.finished")[-1]["final_step"] == 40
