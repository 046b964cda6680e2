"""Asynchronous snapshots with both persisters (a thread, a child process): bit-exact
resume, retries and failures, back-pressure, close waiting for the save in flight, and a
persister process that dies with its worker."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from elastictrain.core import layout
from elastictrain.core.errors import SnapshotWriteFailed
from elastictrain.snapshot.format.reader import list_snapshot_dirs
from elastictrain.storage import open_store
from tests.fault_stores import FailingStore, GatedStore, read_journal
from tests.helpers import REPO, child_env, events, kill_session, pid_alive, wait_for
from tests.small_job import ASYNC, build_plain, train_plain


def named(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


@pytest.mark.processes
@pytest.mark.parametrize("persister", ["sync", *ASYNC])
def test_resume_is_bit_exact_with_every_persister(tmp_path: Path, persister: str) -> None:
    *ref, ref_snap = build_plain(str(tmp_path / "ref"), persister, every_steps=5)
    ref_losses = train_plain(*ref, ref_snap, until=12)
    ref_snap.close()
    *first, first_snap = build_plain(str(tmp_path / "run"), persister, every_steps=5,
                              save_on_close=False)  # ends as if killed after step 8
    train_plain(*first, first_snap, until=8)
    first_snap.close()
    *again, snap = build_plain(str(tmp_path / "run"), persister, seed=1, every_steps=5)
    assert snap.restore().from_step == 5
    losses = train_plain(*again, snap, until=12)
    snap.close()
    assert losses == ref_losses[5:]
    for a, b in zip(ref[0].state_dict().values(), again[0].state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.processes
@pytest.mark.parametrize("persister", ASYNC)
def test_failed_persist_is_retried_and_later_saves_succeed(tmp_path: Path,
                                                           persister: str) -> None:
    store = FailingStore(open_store(str(tmp_path)), failures=2)
    *live, snap = build_plain(store, persister, every_steps=3, retry_backoff_s=0.01,
                       max_consecutive_failures=3)
    with capture_logs() as logs:
        train_plain(*live, snap, until=9)  # saves at 3 (fails twice, then commits), 6, 9
        snap.close()
    failed = named(logs, "snapshot.failed")
    assert [(e["snapshot_step"], e["attempt"], e["will_retry"]) for e in failed] == [
        (3, 1, True), (3, 2, True)]
    assert "injected failure" in failed[0]["error"]
    committed = named(logs, "snapshot.committed")
    assert [(e["snapshot_step"], e["attempts"]) for e in committed] == [(3, 3), (6, 1), (9, 1)]
    assert list_snapshot_dirs(store) == [9, 6, 3]


@pytest.mark.processes
@pytest.mark.parametrize("persister", ASYNC)
def test_consecutive_failures_raise_at_the_next_save_once(tmp_path: Path,
                                                          persister: str) -> None:
    store = FailingStore(open_store(str(tmp_path)), failures=10**6)
    *live, snap = build_plain(store, persister, every_steps=3, retry_backoff_s=0.01,
                       max_consecutive_failures=2, save_on_close=False)  # no last save
    with capture_logs() as logs:
        train_plain(*live, snap, until=3)
        handle = snap._last_handle
        assert handle is not None
        handle.join()  # the background persist gave up
        with pytest.raises(SnapshotWriteFailed):
            handle.wait()  # the handle re-raises the background failure
        train_plain(*live, snap, until=5)  # no per-step collective here: agreed at the next save
        with pytest.raises(SnapshotWriteFailed) as err:
            train_plain(*live, snap, until=6)
        assert snap.step_count == 6  # the step is recorded: every rank raises after it
        train_plain(*live, snap, until=7)  # raised once: the loop may go on if it chooses to
        snap.close()
    message = str(err.value)
    assert "step 3" in message and "2 times in a row" in message and str(tmp_path) in message
    assert "fix:" in message
    assert [(e["attempt"], e["will_retry"]) for e in named(logs, "snapshot.failed")] == [
        (1, True), (2, False)]
    assert not named(logs, "snapshot.committed")


def _stack_of(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident or -1)
    return "".join(traceback.format_stack(frame)) if frame is not None else ""


@pytest.mark.processes
@pytest.mark.parametrize("persister", ASYNC)
def test_backpressure_keeps_one_save_in_flight(tmp_path: Path, persister: str) -> None:
    journal, gate = tmp_path / "journal", tmp_path / "gate"
    store = GatedStore(open_store(str(tmp_path / "run")), str(journal), str(gate))
    *live, snap = build_plain(store, persister, every_steps=2)
    with capture_logs() as logs:
        train_plain(*live, snap, until=2)  # the save of step 2 stalls mid-payload
        wait_for(lambda: read_journal(journal), 60, "the persist of step 2 to start")
        worker = threading.Thread(target=train_plain, args=(*live, snap, 4))
        worker.start()  # step 4 is due while step 2 is still in flight
        wait_for(lambda: "wait_in_flight" in _stack_of(worker), 60,
                 "the training loop to wait for the save in flight")
        assert [line.split()[:2] for line in read_journal(journal)] == [["start", "2"]]
        gate.touch()
        worker.join(timeout=60)
        snap.close()
    assert [line.split()[:2] for line in read_journal(journal)] == [
        ["start", "2"], ["end", "2"], ["start", "4"], ["end", "4"]]
    (wait,) = named(logs, "snapshot.backpressure")
    assert (wait["snapshot_step"], wait["waiting_for_step"]) == (4, 2) and wait["wait_s"] > 0
    order = [(e["event"], e.get("snapshot_step")) for e in logs]
    assert order.index(("snapshot.committed", 2)) < order.index(("snapshot.staged", 4))


@pytest.mark.processes
@pytest.mark.parametrize("persister", ASYNC)
def test_close_waits_for_the_save_in_flight(tmp_path: Path, persister: str) -> None:
    journal, gate = tmp_path / "journal", tmp_path / "gate"
    store = GatedStore(open_store(str(tmp_path / "run")), str(journal), str(gate))
    *live, snap = build_plain(store, persister, every_steps=3)
    train_plain(*live, snap, until=3)
    wait_for(lambda: read_journal(journal), 60, "the persist of step 3 to start")
    closer = threading.Thread(target=snap.close)
    closer.start()
    wait_for(lambda: "close" in _stack_of(closer) and "join" in _stack_of(closer), 60,
             "close() to wait")
    assert list_snapshot_dirs(store) == [] and closer.is_alive()
    gate.touch()
    closer.join(timeout=60)
    assert not closer.is_alive() and list_snapshot_dirs(store) == [3]
    assert snap._last_handle is not None and snap._last_handle.done()


_WORKER = """
import sys, torch
from elastictrain.core import log
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.storage import open_store
from tests.fault_stores import GatedStore
root, journal, gate, events = sys.argv[1:5]
log.configure(events_file=events)
store = GatedStore(open_store(root), journal, gate)
snap = SnapshotManager(store, model=torch.nn.Linear(64, 64), persister="process", every_steps=1)
snap.step().wait()  # stalls mid-payload until the gate opens, which never happens
"""
@pytest.mark.processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_persister_process_dies_with_its_worker(tmp_path: Path) -> None:
    root, journal, gate = tmp_path / "run", tmp_path / "journal", tmp_path / "gate"
    env = child_env(tmp_path, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(root), str(journal), str(gate),
                             str(tmp_path / "ev.jsonl")], env=env, cwd=tmp_path,
                            start_new_session=True)
    try:
        wait_for(lambda: read_journal(journal), 120, "the persist to start")
        (started,) = events(tmp_path, "snapshot.persister_started")
        helper = int(started["pid"])
        assert pid_alive(helper) and f"pid={helper}" in read_journal(journal)[0]
        os.kill(proc.pid, signal.SIGKILL)  # the worker only: the helper is not signalled
        proc.wait(timeout=30)
        wait_for(lambda: not pid_alive(helper), 30, "the helper to die with its worker")
        partial = [n for n in os.listdir(root / layout.SNAPSHOTS) if layout.is_partial(n)]
        assert len(partial) == 1 and list_snapshot_dirs(open_store(str(root))) == []
    finally:
        kill_session(proc)


@pytest.mark.processes
def test_closing_the_process_persister_never_takes_its_exit_for_a_hang(tmp_path: Path) -> None:
    """close() and the pipe's reader thread both joined the helper; the join that lost
    the race for waitpid saw a live process, so close() logged persister_killed ("did
    not exit within 60 s") at once and sent SIGKILL to a reaped pid: 3 closes in 8
    here before the fix. One thread reaps at a time now."""
    with capture_logs() as logs:
        for i in range(8):
            model, opt, snap = build_plain(str(tmp_path / f"r{i}"), "process", every_steps=1)
            train_plain(model, opt, snap, until=1)
            persister = snap._saver.persister
            snap.close()
            assert persister._proc.exitcode == 0  # type: ignore[attr-defined]
    assert not named(logs, "snapshot.persister_killed")


