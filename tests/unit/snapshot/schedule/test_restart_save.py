"""The snapshot before a restart of a healthy group (a node joins): the agent's request,
its agreement at a step boundary, the save (memory where there is a tier, else durable),
the ready mark, and the wait to be stopped (snapshot/schedule/restart_save.py,
rescue_marks.py). The whole path under two real agents:
tests/processes/multinode/test_two_agents.py."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from elastictrain.core.env import RESCUE_MARKS_VAR
from elastictrain.handoff.rescue_marks import (
    LISTENING,
    READY,
    RESCUING,
    SAVE_REQUEST,
    clear_save_marks,
    ready_pids,
    request_save,
)
from elastictrain.launcher.agent import ElasticTrainAgent
from elastictrain.launcher.agent_settings import AgentSettings
from elastictrain.snapshot.format.reader import list_snapshot_dirs
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.snapshot.schedule import restart_save
from elastictrain.snapshot.schedule.restart_save import RestartRequest
from elastictrain.worker.dist import DistContext
from tests.helpers import wait_for


@pytest.fixture
def marks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A launcher's marks directory named to this process, and a short wait to be stopped
    (no agent stops this test)."""
    directory = tmp_path / "marks"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv(RESCUE_MARKS_VAR, str(directory))
    monkeypatch.setattr(restart_save, "RESTART_PAUSE_S", 0.01)
    return directory


def test_a_request_is_answered_once_and_marks_this_worker_ready(marks: Path) -> None:
    request = RestartRequest.from_env()
    assert request is not None and not request.requested()
    request_save(marks)
    assert request.requested()
    assert stat.S_IMODE((marks / SAVE_REQUEST).stat().st_mode) == 0o600
    request.ready()
    assert not request.requested()  # answered: no second save this attempt
    assert ready_pids(marks) == {os.getpid()}
    clear_save_marks(marks)
    assert not os.listdir(marks)


def test_no_launcher_no_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RESCUE_MARKS_VAR, raising=False)
    assert RestartRequest.from_env() is None


def _manager(tmp_path: Path, **settings: Any) -> SnapshotManager:
    ctx = DistContext(0, 1, 0, "gloo", torch.device("cpu"), False)
    return SnapshotManager(str(tmp_path / "s"), model=torch.nn.Linear(2, 2), ctx=ctx,
                           every_steps=10, **settings)


def _steps(snap: SnapshotManager, count: int) -> None:
    for _ in range(count):
        snap.step()


@pytest.mark.parametrize("tier", ["durable", "memory"])
def test_the_step_at_the_request_is_saved_then_training_waits(
        tmp_path: Path, marks: Path, tier: str) -> None:
    settings = ({"memory_every": 5, "memory_dir": str(tmp_path / "memory")}
                if tier == "memory" else {})
    snap = _manager(tmp_path, **settings)
    snap.restore()
    _steps(snap, 13)
    request_save(marks)
    with capture_logs() as logs:
        _steps(snap, 1)  # step 14: agreed, saved, marked ready, waited to be stopped
        _steps(snap, 2)  # not stopped (no agent here): training goes on, no second save
        snap.wait()
    in_memory = list_snapshot_dirs(snap.memory_store) if snap.memory_store else []
    newest_durable = list_snapshot_dirs(snap.store)[0]
    snap.close()  # removes the memory snapshots: the run finished
    assert list_snapshot_dirs(snap.store)[0] == 16  # close() saved the last step
    (saved,) = [e for e in logs if e["event"] == "snapshot.saved_for_restart"]
    assert (saved["snapshot_step"], saved["tier"]) == (14, tier)
    assert [e["snapshot_step"] for e in logs if e["event"] == "snapshot.restart_not_taken"] == [14]
    assert (marks / f"{READY}{os.getpid()}").exists()
    order = [(e["event"], e.get("snapshot_step")) for e in logs]
    # committed before the worker said it was ready
    assert order.index(("snapshot.committed", 14)) < order.index(
        ("snapshot.saved_for_restart", 14))
    if tier == "durable":
        assert newest_durable == 14
    else:
        assert newest_durable == 10  # 14 went to memory only
        # Memory keeps its newest snapshot: 14, or 15 once the step after it committed.
        assert in_memory and in_memory[0] in (14, 15)


def test_a_closing_worker_is_ready_without_a_request(tmp_path: Path, marks: Path) -> None:
    """A worker in close() takes no more steps: the agent need not wait for it."""
    snap = _manager(tmp_path)
    snap.restore()
    _steps(snap, 3)
    snap.close()
    assert ready_pids(marks) == {os.getpid()}


def test_a_worker_taking_no_step_since_its_restore_is_ready_without_a_save(
        tmp_path: Path, marks: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Restoring, or parked before its first step: nothing new to save; the agent is
    told at once instead of waiting its full time for a step."""
    monkeypatch.setattr(restart_save, "IDLE_PATIENCE_S", 0.2)
    snap = _manager(tmp_path)
    snap.restore()
    with capture_logs() as logs:
        request_save(marks)
        wait_for(lambda: ready_pids(marks) == {os.getpid()}, 30, "the idle worker's mark")
        _steps(snap, 2)  # ready already: the agent may stop it any time, no save now
    assert [e["event"] for e in logs if e["event"].startswith("snapshot.restart")] == [
        "snapshot.restart_ready_idle"]
    assert not [e for e in logs if e["event"] == "snapshot.saved_for_restart"]
    snap.close()


def test_a_worker_pausing_after_steps_saves_at_its_next_step(
        tmp_path: Path, marks: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Evaluating, or waiting for data, after steps no snapshot holds: its pause is no
    readiness (the restart would train those steps again). The watch ends without a
    mark; the next step saves and marks."""
    monkeypatch.setattr(restart_save, "IDLE_PATIENCE_S", 0.0)
    snap = _manager(tmp_path)
    snap.restore()
    _steps(snap, 3)  # steps 1-3; no snapshot holds them (every 10)
    # The watch leaves at its first look after a step: it may be gone already.
    watches = [t for t in threading.enumerate() if t.name == "elastictrain-restart-request"]
    with capture_logs() as logs:
        request_save(marks)
        for watch in watches:
            watch.join(timeout=30)  # the pause: its watch has looked and left
        assert not any(w.is_alive() for w in watches) and ready_pids(marks) == set()
        _steps(snap, 1)  # step 4, after the pause: saved, then ready
    assert [e["event"] for e in logs if e["event"].startswith("snapshot.restart")] == [
        "snapshot.restart_not_taken"]
    (saved,) = [e for e in logs if e["event"] == "snapshot.saved_for_restart"]
    assert saved["snapshot_step"] == 4
    assert ready_pids(marks) == {os.getpid()}
    snap.close()


def test_the_agent_waits_only_for_workers_that_listen(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker without a SnapshotManager (a script of its own, or one still importing)
    never answers: the agent must not wait its full time for it; one that listens and
    does not answer is waited for until the limit."""
    agent = ElasticTrainAgent.__new__(ElasticTrainAgent)  # no torchrun agent behind it
    agent.settings = AgentSettings(rescue_dir=tmp_path, rescue_timeout_s=30.0)
    monkeypatch.setattr(agent, "_worker_codes", lambda: {111: None, 222: None})
    started = time.monotonic()
    with capture_logs() as logs:
        agent._save_before_restart()
    assert time.monotonic() - started < 5
    assert (tmp_path / SAVE_REQUEST).exists()
    assert not [e for e in logs if e["event"] == "agent.saved_before_restart"]
    (tmp_path / f"{LISTENING}111").touch()
    (tmp_path / f"{READY}222").touch()  # not listening: its mark changes nothing
    agent.settings = AgentSettings(rescue_dir=tmp_path, rescue_timeout_s=0.2)
    with capture_logs() as logs:
        agent._save_before_restart()
    (waited,) = [e for e in logs if e["event"] == "agent.saved_before_restart"]
    assert (waited["listening"], waited["ready"], waited["timed_out"]) == (1, 0, True)
    (tmp_path / f"{READY}111").touch()
    with capture_logs() as logs:
        agent._save_before_restart()
    (waited,) = [e for e in logs if e["event"] == "agent.saved_before_restart"]
    assert (waited["listening"], waited["ready"], waited["timed_out"]) == (1, 1, False)


def test_a_membership_restart_waits_for_a_rescue_in_progress(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer node lost while this group looks healthy: a worker writing the rescue is
    what the new group resumes from; the agent stops nobody until it is done (its
    process exits), even where every listening worker is ready."""
    agent = ElasticTrainAgent.__new__(ElasticTrainAgent)  # no torchrun agent behind it
    agent.settings = AgentSettings(rescue_dir=tmp_path, rescue_timeout_s=30.0)
    codes: dict[int, int | None] = {111: None, 222: None}
    monkeypatch.setattr(agent, "_worker_codes", lambda: dict(codes))
    for mark in (f"{LISTENING}111", f"{LISTENING}222", f"{READY}111", f"{READY}222",
                 f"{RESCUING}222"):
        (tmp_path / mark).touch()
    done = threading.Event()

    def restart() -> None:
        agent._save_before_restart()
        done.set()

    with capture_logs() as logs:
        thread = threading.Thread(target=restart)
        thread.start()
        assert not done.wait(0.5)  # the rescue holds it (30 s limit)
        codes[222] = 1  # the rescue is done: its worker raises its error and exits
        thread.join(timeout=30)
    assert done.is_set()
    (waited,) = [e for e in logs if e["event"] == "agent.saved_before_restart"]
    assert (waited["rescuing"], waited["timed_out"]) == (0, False)
