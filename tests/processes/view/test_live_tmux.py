"""The live view in a real terminal (tmux on a private socket): progress bar, the kill,
the restart and the resume appear as they happen; the summary follows."""

from __future__ import annotations

import os
import signal
from contextlib import suppress
from pathlib import Path

import pytest

from tests.helpers import events, pid_alive, wait_for
from tests.processes.view.terminal import Tmux

pytestmark = pytest.mark.distributed


def test_demo_live_view_shows_kill_restart_resume(tmp_path: Path, tmux: Tmux) -> None:
    storage = tmp_path / "s"
    env = f"PYTHONPATH={os.environ.get('PYTHONPATH', '')} TMPDIR={tmp_path}"
    command = (f"env {env} elastictrain demo --storage {storage} --steps 150 --kill-at 120; "
               "echo DEMO-EXIT=$?; sleep 600")  # keeps the pane readable after the exit
    tmux.start(command)
    wait_for(lambda: "━" in tmux.pane() and "step " in tmux.pane(), 120,
             "the progress bar", interval=0.3)
    assert "snapshot" in tmux.pane() and "Ctrl-C stops the job" in tmux.pane()
    wait_for(lambda: "worker rank 1 killed by SIGKILL" in tmux.pane(), 120, "the kill line",
             interval=0.3)
    wait_for(lambda: "attempt 1: resumed from step 100 (lost 20 steps)" in tmux.pane(), 120,
             "the resume line", interval=0.3)
    wait_for(lambda: "DEMO-EXIT=" in tmux.pane(), 180, "the demo's exit", interval=0.5)
    screen = tmux.pane()
    assert "DEMO-EXIT=0" in screen
    assert "restart after failure" in screen and "step 150/150" in screen
    assert "launcher exited 0 (finished)" in screen
    assert "elastictrain demo: finished" in screen  # the summary under the final view


def stop_leftovers(events_root: Path) -> None:
    """Stop, by PID, a launcher and workers that outlived the CLI (whatever the Ctrl-C
    handling of the demo leaves running)."""
    for event in events(events_root):
        found = event.get("pids") or {}
        pids = [event.get("pid")] if event.get("event") == "agent.start" else \
            list(found.values() if isinstance(found, dict) else found)
        for pid in pids:
            if isinstance(pid, int) and pid_alive(pid):
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_ctrl_c_in_the_live_view_is_passed_on_and_said(tmp_path: Path,
                                                        tmux: Tmux) -> None:
    storage = tmp_path / "s"
    env = f"PYTHONPATH={os.environ.get('PYTHONPATH', '')} TMPDIR={tmp_path}"
    command = (f"env {env} elastictrain demo --storage {storage} --steps 5000; "
               "echo DEMO-EXIT=$?; sleep 600")
    tmux.start(command)
    try:
        wait_for(lambda: "fresh start" in tmux.pane(), 120, "training to start", interval=0.3)
        tmux.keys("C-c")
        wait_for(lambda: "DEMO-EXIT=" in tmux.pane(), 120, "the demo's exit", interval=0.3)
        screen = tmux.pane()
        # The view says what the signal does; the job takes its final snapshot (exit 75).
        assert "SIGINT: asking the job for a final snapshot" in screen
        assert "DEMO-EXIT=75" in screen
    finally:
        stop_leftovers(storage / "events")
