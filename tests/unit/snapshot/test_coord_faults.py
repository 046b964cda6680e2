"""Faults in combination, in one process: a notice while a save is failing (the final
snapshot is still attempted; exit 75 only if it committed), a slow persist that keeps
moving (not a hang) against one that stalls (a hang), and a manager built without
``ctx``/``config`` (settings from the environment; the process group it finds)."""
from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from elastictrain.core.config import FaultsConfig
from elastictrain.core.errors import EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED, ConfigError
from elastictrain.snapshot.format.reader import list_snapshot_dirs
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.storage import open_store
from elastictrain.storage.faults import FaultyStore
from elastictrain.worker import preempt
from tests.fault_stores import FailingStore, GatedStore, read_journal
from tests.helpers import wait_for


def named(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


def _steps(snap: SnapshotManager, until: int) -> None:
    while snap.step_count < until:
        snap.step()


# -- case 2: a notice while a save is failing --------------------------------------------
def test_notice_while_the_inflight_save_fails_still_takes_the_final_snapshot(
        tmp_path: Path, watcher: preempt.PreemptionWatcher) -> None:
    # The save of step 5 fails twice (= gives up); the final one, of step 7, must still run.
    store = FailingStore(open_store(str(tmp_path)), failures=2)
    snap = SnapshotManager(store, model=torch.nn.Linear(3, 3), every_steps=5,
                           max_consecutive_failures=2, retry_backoff_s=0.01)
    with capture_logs() as logs:
        _steps(snap, 6)
        watcher.notify("signal", "SIGTERM")
        with pytest.raises(SystemExit) as exited:
            snap.step()
    assert exited.value.code == EXIT_PREEMPTED
    assert list_snapshot_dirs(snap.store) == [7]  # the final snapshot committed
    assert named(logs, "preempt.inflight_failed")
    (saved,) = named(logs, "preempt.saved")
    assert saved["snapshot_step"] == 7 and not named(logs, "preempt.failed")


def test_notice_while_the_store_keeps_failing_exits_76_and_says_why(
        tmp_path: Path, watcher: preempt.PreemptionWatcher) -> None:
    store = FailingStore(open_store(str(tmp_path)), failures=10**6)
    snap = SnapshotManager(store, model=torch.nn.Linear(3, 3), every_steps=5,
                           max_consecutive_failures=2, retry_backoff_s=0.01)
    with capture_logs() as logs:
        _steps(snap, 6)
        watcher.notify("signal", "SIGTERM")
        with pytest.raises(SystemExit) as exited:
            snap.step()
    assert exited.value.code == EXIT_PREEMPTED_UNSAVED
    assert list_snapshot_dirs(snap.store) == []
    failed_attempts = {e["snapshot_step"] for e in named(logs, "snapshot.failed")}
    assert failed_attempts == {5, 7}  # the final save was attempted, not skipped
    (failed,) = named(logs, "preempt.failed")
    assert failed["snapshot_step"] == 7 and failed["exit_code"] == EXIT_PREEMPTED_UNSAVED
    assert "SnapshotWriteFailed" in failed["reason"] and "injected failure" in failed["reason"]
    assert not named(logs, "preempt.saved")


def test_notice_during_the_wait_for_a_failing_save_still_takes_the_final_snapshot(
        tmp_path: Path, watcher: preempt.PreemptionWatcher,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Step 1's save gives up after a 1 s back-off; step 2's save waits for it
    # (back-pressure) and the notice comes during that wait, after step 2's agreement.
    store = FailingStore(open_store(str(tmp_path)), failures=10**6)
    snap = SnapshotManager(store, model=torch.nn.Linear(3, 3), every_steps=1,
                           max_consecutive_failures=2, retry_backoff_s=1.0)
    waiting = snap._saver.wait_in_flight

    def notice_while_waiting(step: int) -> None:
        if step == 2:
            watcher.notify("signal", "SIGTERM")
        waiting(step)

    monkeypatch.setattr(snap._saver, "wait_in_flight", notice_while_waiting)
    with capture_logs() as logs:
        snap.step()
        with pytest.raises(SystemExit) as exited:  # was: SnapshotWriteFailed, no final save
            snap.step()
    assert exited.value.code == EXIT_PREEMPTED_UNSAVED
    assert {e["snapshot_step"] for e in named(logs, "snapshot.failed")} == {1, 2}
    (failed,) = named(logs, "preempt.failed")
    assert failed["snapshot_step"] == 2


def test_a_sharded_persist_slowed_call_by_call_is_not_a_hang(
        tmp_path: Path, watchdog_exits: Callable[[], list[int]]) -> None:
    # 0.2 s of injected latency before every storage call: the commit's small writes and
    # retention's listings take several of those in a row, each under the 0.5 s limit.
    store = FaultyStore(open_store(str(tmp_path)), FaultsConfig(latency_s=0.2))
    snap = SnapshotManager(store, model=torch.nn.Linear(8, 8), every_steps=1, sharded=True)
    snap.step()
    snap.wait()
    exits = watchdog_exits()
    with capture_logs() as logs:
        snap.step()
        snap.close()
    assert exits == []  # was [71]: only bytes through open_write counted
    (committed,) = named(logs, "snapshot.committed")
    assert committed["duration_s"] > 0.5  # the persist did outlast the limit


def test_a_persist_that_moves_nothing_is_a_hang(
        tmp_path: Path, watchdog_exits: Callable[[], list[int]]) -> None:
    exits = watchdog_exits()
    journal, gate = tmp_path / "journal", tmp_path / "gate"
    store = GatedStore(open_store(str(tmp_path / "run")), str(journal), str(gate))
    snap = SnapshotManager(store, model=torch.nn.Linear(64, 64), every_steps=1)
    snap.step()  # the persist writes 4 KiB, then stalls until the gate opens
    waiter = threading.Thread(target=snap.wait)
    waiter.start()
    try:
        wait_for(lambda: exits, 30, "the watchdog to fire while wait() sees no bytes move")
        assert exits == [71] and read_journal(journal) == [read_journal(journal)[0]]
    finally:
        gate.touch()
        waiter.join(timeout=60)
        snap.close()


# -- case 11: a manager built without ctx / config -----------------------------------------
def test_settings_from_the_environment_reach_a_manager_built_with_a_url(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTICTRAIN_SNAPSHOT__KEEP", "7")
    monkeypatch.setenv("ELASTICTRAIN_SNAPSHOT__EVERY_STEPS", "13")
    monkeypatch.setenv("ELASTICTRAIN_STORAGE__RETRIES", "9")
    snap = SnapshotManager(str(tmp_path), model=torch.nn.Linear(2, 2), every_steps=4)
    assert snap.config.keep == 7  # the environment, over the defaults
    assert snap.config.every_steps == 4  # an explicit argument, over the environment
    assert snap.store._policy.retries == 9  # type: ignore[attr-defined]


def test_a_world_without_a_process_group_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=2 .*fix: call elastictrain.init\(\)"):
        SnapshotManager(str(tmp_path), model=torch.nn.Linear(2, 2))


