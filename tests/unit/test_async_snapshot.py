"""Async snapshots in one process: thread and process persisters, retries and failures,
back-pressure, flat staging memory, time triggers, and verified loading."""

from __future__ import annotations

import os
import random
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
from elastictrain.core.errors import SnapshotCorrupt, SnapshotWriteFailed
from elastictrain.snapshot.durable.commit import persist_snapshot
from elastictrain.snapshot.format.manifest import SnapshotMeta
from elastictrain.snapshot.format.reader import list_snapshot_dirs, verify_snapshot
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.snapshot.state.rng import capture_rng, restore_rng
from elastictrain.snapshot.state.staging import StagingBuffers
from elastictrain.storage import open_store
from elastictrain.worker.dist import DistContext
from tests.fault_stores import FailingStore, GatedStore, read_journal
from tests.helpers import REPO, child_env, events, kill_session, pid_alive, wait_for

ASYNC = ["thread", "process"]


def make(storage: Any, persister: str = "thread", seed: int = 0,
         **kw: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, SnapshotManager]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.2),
                                torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mode = "sync" if persister == "sync" else "async"
    persister = "thread" if persister == "sync" else persister
    snap = SnapshotManager(storage, model=model, optimizer=opt, mode=mode, persister=persister,
                           **kw)
    return model, opt, snap


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, snap: SnapshotManager,
          until: int) -> list[float]:
    losses = []
    while snap.step_count < until:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        snap.step()
        losses.append(loss.item())
    return losses


def named(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


@pytest.mark.processes
@pytest.mark.parametrize("persister", ["sync", *ASYNC])
def test_resume_is_bit_exact_with_every_persister(tmp_path: Path, persister: str) -> None:
    *ref, ref_snap = make(str(tmp_path / "ref"), persister, every_steps=5)
    ref_losses = train(*ref, ref_snap, until=12)
    ref_snap.close()
    *first, first_snap = make(str(tmp_path / "run"), persister, every_steps=5,
                              save_on_close=False)  # ends as if killed after step 8
    train(*first, first_snap, until=8)
    first_snap.close()
    *again, snap = make(str(tmp_path / "run"), persister, seed=1, every_steps=5)
    assert snap.restore().from_step == 5
    losses = train(*again, snap, until=12)
    snap.close()
    assert losses == ref_losses[5:]
    for a, b in zip(ref[0].state_dict().values(), again[0].state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.processes
@pytest.mark.parametrize("persister", ASYNC)
def test_failed_persist_is_retried_and_later_saves_succeed(tmp_path: Path,
                                                           persister: str) -> None:
    store = FailingStore(open_store(str(tmp_path)), failures=2)
    *live, snap = make(store, persister, every_steps=3, retry_backoff_s=0.01,
                       max_consecutive_failures=3)
    with capture_logs() as logs:
        train(*live, snap, until=9)  # saves at 3 (fails twice, then commits), 6, 9
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
    *live, snap = make(store, persister, every_steps=3, retry_backoff_s=0.01,
                       max_consecutive_failures=2, save_on_close=False)  # no last save
    with capture_logs() as logs:
        train(*live, snap, until=3)
        handle = snap._last_handle
        assert handle is not None
        handle.join()  # the background persist gave up
        with pytest.raises(SnapshotWriteFailed):
            handle.wait()  # the handle re-raises the background failure
        train(*live, snap, until=5)  # no per-step collective here: agreed at the next save
        with pytest.raises(SnapshotWriteFailed) as err:
            train(*live, snap, until=6)
        assert snap.step_count == 6  # the step is recorded: every rank raises after it
        train(*live, snap, until=7)  # raised once: the loop may go on if it chooses to
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
    *live, snap = make(store, persister, every_steps=2)
    with capture_logs() as logs:
        train(*live, snap, until=2)  # the save of step 2 stalls mid-payload
        wait_for(lambda: read_journal(journal), 60, "the persist of step 2 to start")
        worker = threading.Thread(target=train, args=(*live, snap, 4))
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
    *live, snap = make(store, persister, every_steps=3)
    train(*live, snap, until=3)
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


@pytest.mark.parametrize("share_memory", [False, True])
def test_staging_memory_is_flat_over_50_saves(share_memory: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters())
    staging = StagingBuffers(share_memory=share_memory)
    sizes, allocations, pointers = set(), set(), set()
    for _ in range(50):
        model(torch.randn(2, 32)).sum().backward()
        opt.step()
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        staged = staging.stage(state)
        sizes.add(staging.nbytes)
        allocations.add(staging.allocations)
        pointers.add(staged["model"]["0.weight"].data_ptr())
        assert torch.equal(staged["optimizer"]["state"][0]["exp_avg"],
                           opt.state_dict()["state"][0]["exp_avg"])
        assert staged["model"]["0.weight"].is_shared() == share_memory
    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    assert len(sizes) == 1 and len(allocations) == 1 and len(pointers) == 1
    assert state_bytes <= staging.nbytes <= 1.1 * state_bytes


def _tensors(node: Any) -> list[torch.Tensor]:
    if isinstance(node, torch.Tensor):
        return [node]
    if isinstance(node, dict):
        return [t for v in node.values() for t in _tensors(v)]
    if isinstance(node, (list, tuple)):
        return [t for v in node for t in _tensors(v)]
    return []


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _CountingContext(DistContext):
    agreements = 0

    def all_reduce_max(self, values: list[int]) -> list[int]:
        self.agreements += 1
        return super().all_reduce_max(values)


def _saved_steps(snap: SnapshotManager, clock: _Clock, steps: int, dt: float) -> list[int]:
    saved = []
    for _ in range(steps):
        clock.now += dt
        if snap.step() is not None:
            saved.append(snap.step_count)
    snap.close()
    return saved


@pytest.mark.parametrize("every_steps,expected", [(None, [4, 8, 12]),
                                                  (7, [4, 7, 11, 14])])
def test_time_trigger_with_an_injected_clock(tmp_path: Path, every_steps: int | None,
                                             expected: list[int]) -> None:
    clock = _Clock()
    ctx = _CountingContext(0, 1, 0, "gloo", torch.device("cpu"), False)
    snap = SnapshotManager(str(tmp_path), model=torch.nn.Linear(2, 2), ctx=ctx, clock=clock,
                           every_steps=every_steps, every_seconds=10, persister="thread")
    assert _saved_steps(snap, clock, 14, dt=3.0) == expected  # 3 s per step, every 10 s
    assert ctx.agreements == 14 - sum(1 for s in expected if every_steps and s % every_steps == 0)


def test_step_trigger_alone_never_all_reduces(tmp_path: Path) -> None:
    clock = _Clock()
    ctx = _CountingContext(0, 1, 0, "gloo", torch.device("cpu"), False)
    snap = SnapshotManager(str(tmp_path), model=torch.nn.Linear(2, 2), ctx=ctx, clock=clock,
                           every_steps=5, persister="thread")
    assert _saved_steps(snap, clock, 10, dt=100.0) == [5, 10]
    assert ctx.agreements == 0


def test_restore_rng_from_a_loaded_view_at_an_offset(tmp_path: Path) -> None:
    """Staged RNG states share one slab; rank 1's state sits at an offset in it."""
    rank0 = capture_rng()
    torch.rand(7)
    random.random()
    rank1 = capture_rng()
    expected, expected_py = torch.rand(5), [random.random() for _ in range(3)]
    staged = StagingBuffers().stage({"rng": [rank0, rank1]})
    store = open_store(str(tmp_path))
    persist_snapshot(store, staged, SnapshotMeta("t", 1, 0, 2, "crc32"))
    loaded = verify_snapshot(store, 1, load=True).payload
    assert loaded is not None
    assert loaded["rng"][1]["torch"].storage_offset() > 0
    restore_rng(loaded["rng"][1])
    assert torch.equal(torch.rand(5), expected)
    assert [random.random() for _ in range(3)] == expected_py  # python's, from a tensor


def test_restore_rng_accepts_python_state_as_a_tuple() -> None:
    """Snapshots written before session 7 hold python's RNG words as a tuple of ints."""
    state = capture_rng()
    version, internal, gauss = state["python"]
    expected = [random.random() for _ in range(3)]
    restore_rng({**state, "python": (version, tuple(internal.tolist()), gauss)})
    assert [random.random() for _ in range(3)] == expected


@pytest.mark.parametrize("where", ["first", "early", "middle", "last"])
def test_fused_load_detects_a_flipped_byte_anywhere(tmp_path: Path, where: str) -> None:
    store = open_store(str(tmp_path))
    state = {"a": torch.randn(5000), "b": [torch.arange(100)], "n": 3}
    persist_snapshot(store, StagingBuffers().stage(state), SnapshotMeta("t", 2, 0, 1, "crc32"))
    loaded = verify_snapshot(store, 2, load=True).payload
    assert loaded is not None
    assert torch.equal(loaded["a"], state["a"]) and loaded["n"] == 3
    path = tmp_path / layout.step_dir(2) / layout.PAYLOAD
    data = bytearray(path.read_bytes())
    index = {"first": 0, "early": 200, "middle": len(data) // 2, "last": len(data) - 1}[where]
    data[index] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt, match=r"state\.pt"):
        verify_snapshot(store, 2, load=True)


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
            model, opt, snap = make(str(tmp_path / f"r{i}"), "process", every_steps=1)
            train(model, opt, snap, until=1)
            persister = snap._saver.persister
            snap.close()
            assert persister._proc.exitcode == 0  # type: ignore[attr-defined]
    assert not named(logs, "snapshot.persister_killed")
