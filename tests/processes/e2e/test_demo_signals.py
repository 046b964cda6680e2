"""Ctrl-C (in a real terminal: tmux) and SIGTERM to `elastictrain demo`: the signal
reaches the job, which commits a final snapshot; the demo says so, exits 75, and no
process of the run is left. Real torchrun, two gloo workers."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastictrain.core import layout
from elastictrain.core.errors import EXIT_PREEMPTED
from tests.helpers import REPO, child_env, events, pid_alive, started, wait_for

pytestmark = pytest.mark.distributed

DEMO = ["-m", "elastictrain.cli", "demo", "--steps=100000", "--snapshot-every=10"]
FINAL = re.compile(r"interrupted \((SIGINT|SIGTERM)\): final snapshot at step (\d+) committed; "
                   r"resume with the same command")


def committed(storage: Path, step: int) -> bool:
    return (storage / layout.step_dir(step) / layout.MANIFEST).exists()


def run_pids(storage: Path) -> list[int]:
    """The launchers' and every worker's pid, from the run's events (the multi-node
    runner also writes each agent's pid to ``node<i>/agent.pid``)."""
    ev = storage / "events"
    agents = {int(e["pid"]) for e in events(ev, "agent.start")}
    agents |= {int(p.read_text()) for p in ev.rglob("agent.pid")}
    return sorted(agents) + [int(e["pid"]) for e in events(ev, "worker.start")]


def assert_stopped_with_final_snapshot(storage: Path, output: str, sig: str,
                                       launchers: int = 1) -> None:
    found = FINAL.search(output)
    assert found and found.group(1) == sig, output[-4000:]
    step = int(found.group(2))
    assert committed(storage, step)
    assert {e["snapshot_step"] for e in events(storage / "events", "preempt.saved")} == {step}
    pids = run_pids(storage)
    assert len(pids) == launchers + 2, pids  # the launchers, two workers
    wait_for(lambda: not any(pid_alive(p) for p in pids), 30, "no process of the run left")


@pytest.fixture
def tmux() -> Iterator[list[str]]:
    """A private tmux server (its own socket), killed at the end."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    # Unique on this machine: tmp_path's name is not (two xdist workers' tests of one
    # name get the same one), and a shared server's kill-server ends the other's session.
    base = ["tmux", "-L", f"et-{uuid.uuid4().hex[:12]}"]
    try:
        yield base
    finally:
        subprocess.run([*base, "kill-server"], capture_output=True, check=False)


@pytest.mark.parametrize("nodes", [
    pytest.param([], id="one-node"),
    # Two agents ("nodes", one worker each) under the multi-node runner: the notice
    # goes to every agent, and no agent or worker is left.
    pytest.param(["--nnodes=2", "--nproc=1"], id="two-nodes"),
])
def test_ctrl_c_in_a_terminal_takes_a_final_snapshot(tmp_path: Path, tmux: list[str],
                                                     nodes: list[str]) -> None:
    storage, rc = tmp_path / "s", tmp_path / "rc"
    env = child_env(tmp_path, PYTHONPATH=str(REPO))
    command = (f"cd {shlex.quote(str(tmp_path))} && "
               + shlex.join([sys.executable, *DEMO, f"--storage={storage}", *nodes])
               + f"; echo $? > {shlex.quote(str(rc))}; exec cat")  # the pane stays to read
    subprocess.run([*tmux, "new-session", "-d", "-s", "demo", "-x", "200", "-y", "50", command],
                   env=env, check=True)
    try:
        wait_for(lambda: committed(storage, 10), 180, "training (the snapshot of step 10)")
        subprocess.run([*tmux, "send-keys", "-t", "demo", "C-c"], check=True)
        wait_for(rc.exists, 180, "the demo to exit")
        pane = subprocess.run([*tmux, "capture-pane", "-p", "-J", "-S", "-200", "-t", "demo"],
                              capture_output=True, text=True, check=True).stdout
        assert int(rc.read_text()) == EXIT_PREEMPTED, pane
        assert "SIGINT: asking the job for a final snapshot" in pane
        assert_stopped_with_final_snapshot(storage, pane, "SIGINT", launchers=2 if nodes else 1)
    finally:
        _kill(storage)


def test_sigterm_to_the_demo_takes_a_final_snapshot(tmp_path: Path) -> None:
    storage = tmp_path / "s"
    cmd = [sys.executable, *DEMO, f"--storage={storage}"]
    try:
        with started(cmd, tmp_path, "demo.log", PYTHONPATH=str(REPO)) as demo:
            wait_for(lambda: committed(storage, 10), 180, "training (the snapshot of step 10)")
            demo.send_signal(signal.SIGTERM)
            code = demo.wait(timeout=180)
        output = (tmp_path / "demo.log").read_text()
        assert code == EXIT_PREEMPTED, output[-4000:]
        assert_stopped_with_final_snapshot(storage, output, "SIGTERM")
    finally:
        _kill(storage)


def _kill(storage: Path) -> None:
    """Whatever a failed test left of the run, by PID (a test that passed left nothing);
    a pid counts only while its command line names this test's storage."""
    for pid in run_pids(storage):
        with contextlib.suppress(OSError):
            if str(storage).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
