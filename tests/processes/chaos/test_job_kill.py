"""Stopping a trial's processes leaves none behind even while one of them forks: a
process that forks while the kill lists /proc (a standby starting a worker) has a
child that the list did not see, and a second round finds it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastictrain.chaos.job import MARKER_VAR, kill_marked, processes_with_marker
from tests.helpers import wait_for

pytestmark = pytest.mark.processes

# Forks a child every millisecond; each child sleeps. All carry the marker.
FORKING = """
import os, time
while True:
    if os.fork() == 0:
        time.sleep(3600)
        os._exit(0)
    time.sleep(0.001)
"""


@pytest.mark.parametrize("round_", range(5))
def test_a_process_forking_during_the_kill_leaves_no_child(tmp_path: Path, round_: int
                                                           ) -> None:
    marker = f"test-{os.getpid()}-{tmp_path.name}"
    parent = subprocess.Popen([sys.executable, "-c", FORKING],
                              env={**os.environ, MARKER_VAR: marker})
    try:
        wait_for(lambda: len(processes_with_marker(marker)) > 20, 60, "children forked")
        killed = kill_marked(marker, timeout_s=30)
        assert parent.pid in killed
        assert processes_with_marker(marker) == []
    finally:
        for pid in processes_with_marker(marker):  # whatever the assertions say
            os.kill(pid, 9)
        parent.kill()
        parent.wait()
