"""A SIGKILLed launcher's rescue marks are removed by the next launch on the node."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elastictrain.handoff.rescue_marks import launch_marks


def _launcher_holding_marks(shm: Path) -> tuple[subprocess.Popen[str], Path]:
    """A real process inside ``launch_marks`` (as ``elastictrain run`` is), waiting."""
    code = ("import sys\nfrom elastictrain.handoff.rescue_marks import launch_marks\n"
            "with launch_marks() as path:\n    print(path, flush=True)\n"
            "    sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "ELASTICTRAIN_SHM": str(shm)})
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


@pytest.mark.processes
def test_marks_of_a_killed_launcher_go_with_the_next_launch(shm: Path) -> None:
    killed, left = _launcher_holding_marks(shm)
    running, kept = _launcher_holding_marks(shm)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert left.is_dir() and kept.is_dir()  # SIGKILL: nothing of it cleaned up
        with launch_marks() as mine:
            assert mine is not None and mine.is_dir()
            assert not left.exists()  # no launcher holds it: removed at once
            assert kept.is_dir()  # a running launcher's marks stay
        assert not mine.exists()
    finally:
        for proc in (killed, running):
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
            if proc.stdin is not None:
                proc.stdin.close()
            if proc.stdout is not None:
                proc.stdout.close()


