"""A launcher's rescue marks serve only that launcher: one that was SIGKILLed leaves them
behind, and the next launcher on the node removes them (whatever their age); those of
a launcher still running are kept. A listing of node memory while a run writes and
prunes there does not fail on files that vanish under it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from elastictrain.handoff.rescue_marks import launch_marks
from elastictrain.snapshot.memory import memory


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "shm"
    root.mkdir(mode=0o1777)
    monkeypatch.setenv("ELASTICTRAIN_SHM", str(root))
    return root


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


def test_listing_node_memory_while_a_run_writes_and_prunes_there(shm: Path) -> None:
    run = memory.user_root() / f"{memory.RUN_PREFIX}abc"
    partial = run / "snapshots" / "partial"
    partial.mkdir(parents=True)
    (run / "kept").write_bytes(b"y" * 5)
    stop = threading.Event()

    def writer() -> None:  # temporary files that come and go, as a save's do
        n = 0
        while not stop.is_set():
            for i in range(50):
                (partial / f"tmp-{n}-{i}").write_bytes(b"x")
            for i in range(50):
                (partial / f"tmp-{n}-{i}").unlink()
            n += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(300):
            (held,) = memory.held()
            assert held.path == run and held.size_bytes >= 5
    finally:
        stop.set()
        thread.join()


def test_a_sweep_while_a_launcher_makes_its_marks_leaves_them(
        shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another launcher of this user sweeps at the moment this one has made its marks
    directory and not yet locked it: the directory is not taken for an abandoned one
    (the agent would wait for no rescue, the workers get no channel)."""
    from elastictrain.handoff import rescue_marks

    real_hold = rescue_marks.hold

    def hold_after_a_sweep(path: Path, what: str) -> int:
        rescue_marks.sweep_marks()  # the other launcher's, between mkdir and lock
        return real_hold(path, what)

    monkeypatch.setattr(rescue_marks, "hold", hold_after_a_sweep)
    with launch_marks() as mine:
        assert mine is not None and mine.is_dir()
        assert rescue_marks.sweep_marks() == []  # held: another sweep leaves it too
        assert mine.is_dir() and mine.name.startswith(rescue_marks.MARKS_PREFIX)
    assert not mine.exists()
