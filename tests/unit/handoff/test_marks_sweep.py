"""A launcher's rescue marks serve only that launcher: one that was SIGKILLed leaves them
behind, and the next launcher on the node removes them (whatever their age); those of
a launcher still running are kept. A listing of node memory while a run writes and
prunes there does not fail on files that vanish under it."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from elastictrain.handoff.rescue_marks import launch_marks
from elastictrain.snapshot.memory import memory


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


