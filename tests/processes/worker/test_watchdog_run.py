"""The hang watchdog's real exits in a child process: 71 from the watchdog, and the
faulthandler backstop when the GIL is held."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from elastictrain.core.errors import EXIT_HANG
from tests.helpers import REPO, child_env

CHILD = """
import re, sys, threading
from elastictrain.core import log
from elastictrain.worker import watchdog
from elastictrain.core.config import WatchdogConfig
log.configure("info", json_output=True, events_file={events!r})
dog = watchdog.install(WatchdogConfig(timeout_s=0.5, check_interval_s=0.1, backstop=True))
dog.beat(3)
def blocked_forever():
    {block}
blocked_forever()
"""


def run_child(tmp_path: Path, block: str) -> tuple[int, str]:
    script = CHILD.format(events=str(tmp_path / "ev.jsonl"), block=block)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=child_env(tmp_path, PYTHONPATH=str(REPO)))
    return proc.returncode, proc.stderr


@pytest.mark.processes
def test_child_exits_71_and_logs_where_it_hung(tmp_path: Path) -> None:
    code, stderr = run_child(tmp_path, "threading.Event().wait()")
    assert code == EXIT_HANG, stderr[-2000:]
    fired = (tmp_path / "ev.jsonl").read_text()
    assert '"watchdog.fired"' in fired and "blocked_forever" in fired


@pytest.mark.processes
def test_backstop_exits_when_the_gil_is_held(tmp_path: Path) -> None:
    # The regex engine holds the GIL for (practically) ever: the watchdog thread
    # cannot run, faulthandler's C timer still dumps the stacks and exits.
    code, stderr = run_child(tmp_path, "re.match(r'(a+)+$', 'a' * 60 + 'b')")
    assert code == 1, stderr[-2000:]
    assert "Timeout" in stderr and "blocked_forever" in stderr


