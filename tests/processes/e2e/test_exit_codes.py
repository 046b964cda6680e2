"""Exit codes of workers end to end: an elastictrain error that reaches the top of a
worker after ``et.init()`` exits with its own code (78 for a fatal one) after one
``worker.error`` event, the agent does not restart a fatal group, and
``elastictrain run`` exits 78. Real torchrun, two gloo workers."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from elastictrain.core.errors import EXIT_FATAL
from tests.helpers import REPO, events, run_cli, started, wait_for
from tests.processes.e2e.test_preemption import Job, assert_preempted

pytestmark = pytest.mark.distributed

JOB = str(REPO / "tests" / "processes" / "e2e" / "fatal_job.py")


def job_env(tmp_path: Path) -> dict[str, str]:
    return {"ELASTICTRAIN_LOG__EVENTS_DIR": str(tmp_path / "ev"), "PYTHONPATH": str(REPO)}


def test_fatal_worker_error_stops_the_run_with_78(tmp_path: Path) -> None:
    """One fatal error class end to end: that every fatal class (ConfigError,
    ResumeMismatchError, StoragePermissionError) exits 78 with its worker.error event is
    tests/unit/worker/test_exit_hook.py's; here the agent stops the run on that 78."""
    error = "StoragePermissionError"
    result = run_cli(["run", "--nproc-per-node=2", "--max-restarts=3",
                      f"--log-dir={tmp_path / 'logs'}", JOB, str(tmp_path / "s"), error],
                     tmp_path, timeout=240, **job_env(tmp_path))
    assert result.returncode == EXIT_FATAL, result.stderr[-4000:]
    ev = tmp_path / "ev"
    assert len(events(ev, "agent.attempt_started")) == 1  # never restarted
    assert not events(ev, "agent.restart")
    assert events(ev, "agent.fatal")
    assert events(ev, "agent.finished")[-1]["exit_code"] == EXIT_FATAL
    reported = events(ev, "worker.error")
    assert {e["rank"] for e in reported} <= {0, 1} and reported
    assert all(e["error"] == error and e["exit_code"] == EXIT_FATAL for e in reported)
    assert all("planted" in e["message"] for e in reported)
    assert "Traceback" not in result.stderr


def test_an_unwritable_storage_stops_the_readme_example_in_one_attempt(tmp_path: Path) -> None:
    """The README's example given a storage path with a file in its way: every worker
    stops in its first attempt with 78, the summary says which path and the fix, no
    traceback, nothing written beside the file."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = run_cli(["run", "--nproc-per-node=2", "--no-view", f"--log-dir={tmp_path / 'logs'}",
                      str(REPO / "examples" / "ddp_resumable.py"), str(blocker / "ckpt")],
                     tmp_path, timeout=240, **job_env(tmp_path))
    assert result.returncode == EXIT_FATAL, result.stderr[-4000:]
    assert len(events(tmp_path / "ev", "agent.attempt_started")) == 1
    assert f"the snapshot storage cannot be written: create {blocker / 'ckpt'}" in result.stderr
    assert "fix: pass a directory" in result.stderr
    assert "Traceback" not in result.stderr
    assert blocker.read_text() == "x"


def test_fatal_worker_error_under_plain_torchrun_exits_78(tmp_path: Path) -> None:
    """Plain torchrun knows nothing of 78: the worker exits 78, torchrun itself exits 1
    (docs/exit-codes.md); its failure report names the worker's exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
           "--max-restarts=0", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
           f"--log-dir={tmp_path / 'logs'}", JOB, str(tmp_path / "s"), "ConfigError"]
    with started(cmd, tmp_path, "torchrun.log", **job_env(tmp_path)) as proc:
        code = proc.wait(timeout=240)
    log = (tmp_path / "torchrun.log").read_text()
    assert code == 1, log[-4000:]
    assert f"exitcode  : {EXIT_FATAL}" in log, log[-4000:]
    reported = events(tmp_path / "ev", "worker.error")
    assert [e["exit_code"] for e in reported] == [EXIT_FATAL]
    assert 'fatal_job.py", line' not in log  # torchrun's own traceback only, not the worker's


def test_sigint_to_the_launcher_is_a_notice(tmp_path: Path) -> None:
    """Ctrl-C on `elastictrain run` (SIGINT to the launcher) reaches the workers as a
    notice: final snapshot of the step in progress, exit 75 (before: SIGINT to the
    workers, a KeyboardInterrupt traceback, exit 130, no final snapshot)."""
    job = Job(tmp_path)
    with job.start() as launcher:
        wait_for(lambda: job.committed(10), 180, "the first periodic snapshot")
        os.kill(launcher.pid, signal.SIGINT)
        code = launcher.wait(timeout=240)
    assert assert_preempted(job, code) > 10
    forwarded = job.of("agent.signal_forwarded")
    assert forwarded[0]["received"] == "SIGINT" and forwarded[0]["signal"] == "SIGTERM"


def test_a_torn_error_file_is_set_aside_and_the_group_restarts(tmp_path: Path) -> None:
    """torch's agent dies on a worker's error file that is not JSON (JSONDecodeError, the
    launcher exits 1 and nothing restarts): elastictrain's agent moves it aside first,
    and the failure counts by its exit code."""
    job = str(REPO / "tests" / "processes" / "e2e" / "torn_error_job.py")
    result = run_cli(["run", "--nproc-per-node=1", "--max-restarts=1",
                      f"--log-dir={tmp_path / 'logs'}", job], tmp_path, timeout=240,
                     **job_env(tmp_path))
    assert result.returncode == 0, result.stderr[-4000:]
    ev = tmp_path / "ev"
    (torn,) = events(ev, "agent.error_file_torn")
    assert torn["local_rank"] == 0 and torn["size_bytes"] == len('{"message": {"message": "cut sh')
    assert Path(torn["path"]).exists()
    assert len(events(ev, "agent.attempt_started")) == 2
