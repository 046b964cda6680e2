"""A node counts as halted only once every thread of its real processes stopped."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from elastictrain.chaos.nodes import halted
from tests.helpers import wait_for


@pytest.mark.processes
def test_a_node_counts_as_halted_only_once_every_thread_stopped() -> None:
    """The harness wipes a lost node's memory only once its processes stopped: a thread
    still in a system call would write into the wiped directory."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert not halted(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        wait_for(lambda: halted(proc.pid), 30, "the process to stop")
        os.kill(proc.pid, signal.SIGCONT)
        wait_for(lambda: not halted(proc.pid), 30, "the process to run again")
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert halted(proc.pid)  # gone


