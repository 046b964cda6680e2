"""`elastictrain run`'s live view in a real terminal (tmux) for a script that fails: the
first failing worker's traceback end and its log under its line, the summary naming
them, and the script's own output (rank 0's by default, ``--view-ranks`` others) shown
under the events. Real torchrun, two gloo workers."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.helpers import REPO, events, wait_for
from tests.processes.view.terminal import Tmux

pytestmark = pytest.mark.distributed

JOB = REPO / "tests" / "processes" / "launcher" / "early_failure_job.py"
SOURCE = "import no_such_module_for_the_test"
ERROR = "ModuleNotFoundError: No module named 'no_such_module_for_the_test'"


def run_in_view(tmp_path: Path, tmux: Tmux, when: str, *options: str) -> str:
    """Run the job in the view until the launcher exits; the screen then."""
    # pytest exports COLUMNS=80 and LINES=24, which rich would take over the pane's size.
    env = f"-u COLUMNS -u LINES PYTHONPATH={REPO} TMPDIR={tmp_path}"
    tmux.start(f"cd {tmp_path} && env {env} {os.sys.executable} -m elastictrain.cli run "
               f"--nproc-per-node 2 {' '.join(options)} {JOB} {tmp_path / 's'} {when}; "
               "echo RUN-EXIT=$?; sleep 600")  # the sleep keeps the pane readable after it
    wait_for(lambda: "RUN-EXIT=" in tmux.pane(), 240, "the launcher's exit", interval=0.3)
    return tmux.pane()


def squeezed(text: str) -> str:
    """``text`` without white space: a long path folded over lines reads whole again."""
    return re.sub(r"\s+", "", text)


def first_failure(tmp_path: Path) -> dict[str, object]:
    found = [e for e in events(tmp_path / "elastictrain-run" / "events", "agent.worker_failed")
             if e.get("first")]
    assert found, "no agent.worker_failed event with first: true"
    return found[0]


def test_a_failure_before_init_shows_its_traceback_log_and_the_scripts_output(
        tmp_path: Path, tmux: Tmux) -> None:
    screen = run_in_view(tmp_path, tmux, "before")
    assert "RUN-EXIT=78" in screen, screen
    # Under the first failure's line: the line raising it, the exception, the log.
    assert re.search(r"worker rank \d exited 1 \(error\): ModuleNotFoundError at"
                     r"\s+\S*early_failure_job.py:\d+", screen), screen
    assert SOURCE in screen and ERROR in screen, screen
    failed = first_failure(tmp_path)
    log = str(failed["output_file"])
    assert log.endswith("stderr.log") and ERROR in Path(tmp_path, log).read_text()
    assert squeezed(f"log: {log}") in squeezed(screen), screen
    assert "(the same error as before)" in screen, screen  # attempt 1: not again in full
    assert "crash loop: 2 attempts failed with ModuleNotFoundError" in screen, screen
    assert "(before any step); not restarted" in screen, screen
    # The script's print: rank 0's only, by default; no event as JSON.
    assert "[rank 0] hello from rank 0" in screen, screen
    assert "hello from rank 1" not in screen and '"event"' not in screen, screen
    # The summary under the view names the same.
    summary = screen[screen.index("elastictrain run: exit 78"):]
    assert "before elastictrain.init()" in summary and SOURCE in summary, summary
    assert "worker log:" in summary and "crash loop:" in summary, summary


def test_a_failure_after_init_shows_its_traceback_and_other_ranks_on_request(
        tmp_path: Path, tmux: Tmux) -> None:
    screen = run_in_view(tmp_path, tmux, "after", "--view-ranks", "1")
    assert "RUN-EXIT=78" in screen, screen  # the same error at the same step: a crash loop
    assert SOURCE in screen and ERROR in screen, screen
    log = str(first_failure(tmp_path)["output_file"])
    assert squeezed(f"log: {log}") in squeezed(screen), screen
    assert "[rank 1] hello from rank 1" in screen, screen
    assert "hello from rank 0" not in screen, screen
