"""The post-trial check for processes left behind finds a real child by its marker."""
from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from elastictrain.chaos import checks
from elastictrain.chaos.job import MARKER_VAR, processes_with_marker
from tests.helpers import child_env, kill_session, pid_alive, wait_for


@pytest.mark.processes
def test_a_process_left_behind_is_found_by_its_marker(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            env=child_env(tmp_path, **{MARKER_VAR: f"{marker}/0"}),
                            start_new_session=True)
    try:
        wait_for(lambda: processes_with_marker(marker) == [proc.pid], 30, "the marked process")
        assert processes_with_marker(f"{marker}/1") == []  # another launch's marker
        assert str(proc.pid) in str(checks.check_leftovers(processes_with_marker(marker)))
    finally:
        kill_session(proc)
    assert not pid_alive(proc.pid)
    assert checks.check_leftovers(processes_with_marker(marker)) is None


