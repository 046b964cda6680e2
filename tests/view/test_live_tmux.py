"""The live view in a real terminal (tmux on a private socket): progress bar, the kill,
the restart and the resume appear as they happen; the summary follows."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from tests.helpers import events, pid_alive, wait_for

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[list[str]]:
    """``tmux -L <unique>``: a private server, killed at the end (with what runs in it)."""
    cmd = ["tmux", "-L", f"et-view-{uuid.uuid4().hex[:8]}"]
    try:
        yield cmd
    finally:
        subprocess.run([*cmd, "kill-server"], capture_output=True, check=False)


def pane(tmux: list[str]) -> str:
    return subprocess.run([*tmux, "capture-pane", "-p", "-S", "-60"], capture_output=True,
                          text=True, check=False).stdout


def test_demo_live_view_shows_kill_restart_resume(tmp_path: Path, tmux: list[str]) -> None:
    storage = tmp_path / "s"
    env = f"PYTHONPATH={os.environ.get('PYTHONPATH', '')} TMPDIR={tmp_path}"
    command = (f"env {env} elastictrain demo --storage {storage} --steps 300 --kill-at 120; "
               "echo DEMO-EXIT=$?; sleep 600")  # keeps the pane readable after the exit
    subprocess.run([*tmux, "new-session", "-d", "-x", "120", "-y", "40", command], check=True)
    wait_for(lambda: "━" in pane(tmux) and "step " in pane(tmux), 120,
             "the progress bar", interval=0.3)
    assert "snapshot" in pane(tmux) and "Ctrl-C stops the job" in pane(tmux)
    wait_for(lambda: "worker rank 1 killed by SIGKILL" in pane(tmux), 120, "the kill line",
             interval=0.3)
    wait_for(lambda: "attempt 1: resumed from step 100 (lost 20 steps)" in pane(tmux), 120,
             "the resume line", interval=0.3)
    wait_for(lambda: "DEMO-EXIT=" in pane(tmux), 180, "the demo's exit", interval=0.5)
    screen = pane(tmux)
    assert "DEMO-EXIT=0" in screen
    assert "restart after failure" in screen and "step 300/300" in screen
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
                                                        tmux: list[str]) -> None:
    storage = tmp_path / "s"
    env = f"PYTHONPATH={os.environ.get('PYTHONPATH', '')} TMPDIR={tmp_path}"
    command = (f"env {env} elastictrain demo --storage {storage} --steps 5000; "
               "echo DEMO-EXIT=$?; sleep 600")
    subprocess.run([*tmux, "new-session", "-d", "-x", "120", "-y", "40", command], check=True)
    try:
        wait_for(lambda: "fresh start" in pane(tmux), 120, "training to start", interval=0.3)
        subprocess.run([*tmux, "send-keys", "C-c"], check=True)
        wait_for(lambda: "DEMO-EXIT=" in pane(tmux), 120, "the demo's exit", interval=0.3)
        screen = pane(tmux)
        # The view says what the signal does; the job takes its final snapshot (exit 75).
        assert "SIGINT: asking the job for a final snapshot" in screen
        assert "DEMO-EXIT=75" in screen
    finally:
        stop_leftovers(storage / "events")
