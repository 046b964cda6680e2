"""A script that fails before ``et.init()`` under ``elastictrain run``, off a terminal: the
summary names the error, the line and its log, and the same failure twice is a crash
loop (exit 78) instead of restarts used up. Real torchrun, two gloo workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastictrain.core.errors import EXIT_FATAL
from tests.helpers import REPO, events, run_cli

pytestmark = pytest.mark.distributed

JOB = REPO / "tests" / "processes" / "launcher" / "early_failure_job.py"
SOURCE = "import no_such_module_for_the_test"
ERROR = "ModuleNotFoundError: No module named 'no_such_module_for_the_test'"
LINE = next(i for i, text in enumerate(JOB.read_text().splitlines(), 1) if SOURCE in text)


def run_job(tmp_path: Path, *options: str, **env: str) -> tuple[str, Path]:
    """``elastictrain run --no-view`` of the job; its exit must be 78 after two attempts.
    Returns its stderr and its events dir."""
    ev = tmp_path / "ev"
    result = run_cli(["run", "--no-view", "--nproc-per-node=2", "--max-restarts=3", *options,
                      str(JOB), str(tmp_path / "s"), "before"], tmp_path, timeout=240,
                     ELASTICTRAIN_LOG__EVENTS_DIR=str(ev), PYTHONPATH=str(REPO), **env)
    assert result.returncode == EXIT_FATAL, result.stderr[-4000:]
    assert len(events(ev, "agent.attempt_started")) == 2  # not the four of --max-restarts
    loop = events(ev, "agent.crash_loop")
    assert len(loop) == 1 and loop[0]["error"] == "ModuleNotFoundError", loop
    assert loop[0]["before_init"] is True
    assert loop[0]["where"].endswith(f"early_failure_job.py:{LINE}"), loop
    if not options:  # output as torchrun gives it: the script's print on stdout, unprefixed
        assert "hello from rank 0\n" in result.stdout, result.stdout[-2000:]
    return result.stderr, ev


def summary(stderr: str) -> str:
    assert "elastictrain run: exit 78" in stderr, stderr[-4000:]
    return stderr[stderr.index("elastictrain run: exit 78"):]


def test_a_failure_before_init_is_a_crash_loop_named_in_the_summary(tmp_path: Path) -> None:
    stderr, _ = run_job(tmp_path)
    shown = summary(stderr)
    assert f"  error:           {ERROR}" in shown, shown
    assert f"early_failure_job.py:{LINE} (rank " in shown and "before elastictrain.init()" in shown
    assert SOURCE in shown, shown
    assert "the worker wrote to the launcher's stderr" in shown, shown  # no file: the terminal
    assert "crash loop:      the same error at the same place before any step in 2" in shown


def test_without_the_standby_the_workers_stderr_file_names_it(tmp_path: Path) -> None:
    """Workers started as new processes (no standby): the agent reads the traceback from
    the end of the stderr file torchrun redirected."""
    logs = tmp_path / "logs"
    stderr, _ = run_job(tmp_path, "--redirects=3", f"--log-dir={logs}",
                        ELASTICTRAIN_LAUNCH__STANDBY="false")
    shown = summary(stderr)
    assert f"  error:           {ERROR}" in shown and SOURCE in shown, shown
    line = next(x for x in shown.splitlines() if x.startswith("    worker log:"))
    log = Path(line.split(":", 1)[1].strip())
    assert log.name == "stderr.log" and log.parent.parent.name == "attempt_1", line
    assert log.is_relative_to(logs) and ERROR in log.read_text()
