"""The grace watch ends a process whose main thread cannot act on a notice."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, wait_for

pytestmark = pytest.mark.processes

# The main thread sits in a call that resumes after every signal, as torchrun's agent does
# in a C++ store wait: its handler runs (or not) but nothing ends the wait.
STUCK = '''
import signal, subprocess, sys, time
from elastictrain.launcher import gracewatch
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                         start_new_session=True)
signal.signal(signal.SIGTERM, lambda *_: None)
signal.signal(signal.SIGUSR2, lambda *_: None)
expired = lambda signum: ([child.pid], 40 + (signum == signal.SIGTERM))
with gracewatch.watching(float(sys.argv[1]), frozenset({int(signal.SIGTERM)}), expired):
    print(child.pid, flush=True)
    while True:
        time.sleep(3600)
'''


def _start(tmp_path: Path, grace_s: float) -> tuple[subprocess.Popen[str], int]:
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    proc = subprocess.Popen([sys.executable, str(script), str(grace_s)], text=True,
                            stdout=subprocess.PIPE, cwd=REPO, start_new_session=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _stop(proc: subprocess.Popen[str], child: int) -> None:
    for pid in (proc.pid, child):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_a_notice_ends_the_process_after_the_grace(tmp_path: Path) -> None:
    proc, child = _start(tmp_path, grace_s=1.0)
    try:
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 41  # on_expire's code
        assert time.monotonic() - started >= 1.0  # not before the grace ran out
        wait_for(lambda: not os.path.exists(f"/proc/{child}") or
                 Path(f"/proc/{child}/stat").read_text().split()[2] == "Z", 10,
                 "the child's group SIGKILLed")
    finally:
        _stop(proc, child)


def test_without_a_notice_nothing_happens(tmp_path: Path) -> None:
    proc, child = _start(tmp_path, grace_s=0.2)
    try:
        proc.send_signal(signal.SIGUSR2)  # handled, but not a notice: no countdown
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1.5)
    finally:
        _stop(proc, child)
