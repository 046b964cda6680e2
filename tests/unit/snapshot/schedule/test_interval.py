"""The automatic snapshot interval: Young/Daly, the MTBF estimate, the run's failure
history, bounds and re-evaluation, config validation, and the manager's use of it."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from elastictrain.core.config import load_settings
from elastictrain.core.errors import ConfigError
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.snapshot.schedule.interval import (
    FailureHistory,
    IntervalPolicy,
    estimate_mtbf_s,
    failure_history,
    interval_steps,
    young_daly_s,
)
from elastictrain.worker.dist import DistContext


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _steps_saving(snap: SnapshotManager, clock: _Clock, steps: int) -> list[int]:
    """Take ``steps`` steps of one clock second each; the steps that saved."""
    saved = []
    for _ in range(steps):
        clock.now += 1.0
        if snap.step() is not None:
            saved.append(snap.step_count)
    return saved


def test_young_daly_and_the_mtbf_estimate() -> None:
    assert young_daly_s(2.0, 3600.0) == pytest.approx(120.0)
    # With failures: the run's own record, uptime / failures, within 10 s .. 15 days.
    assert estimate_mtbf_s(400.0, 4, prior_s=3600.0) == pytest.approx(100.0)
    assert estimate_mtbf_s(1e6, 1000, prior_s=3600.0) == pytest.approx(1000.0)
    assert estimate_mtbf_s(5.0, 1, prior_s=3600.0) == pytest.approx(10.0)  # the short bound
    assert estimate_mtbf_s(1e9, 1, prior_s=3600.0) == pytest.approx(3600.0 * 360)
    assert interval_steps(10.0, 3.0) == 3 and interval_steps(0.1, 3.0) == 1


def test_mtbf_before_the_first_failure_starts_short_and_grows_with_uptime() -> None:
    """A prior flat in log(rate) over 10 s .. 15 days: its mean rate is dominated by
    the fast-failing end (a new run snapshots as if failures might be minutes apart),
    and every failure-free second rules those out, so the estimate grows about with
    the uptime, past it, and never beyond the long bound."""
    uptimes = [0.0, 10.0, 60.0, 600.0, 3600.0, 86400.0, 1e8]
    estimates = [estimate_mtbf_s(t, 0, prior_s=3600.0) for t in uptimes]
    assert 50.0 < estimates[0] < 3600.0  # below the prior's centre: the rate's mean
    assert estimates == sorted(estimates) and len(set(estimates)) == len(estimates)
    assert all(e > t for e, t in zip(estimates[1:-1], uptimes[1:-1], strict=True))
    assert estimates[-1] == pytest.approx(3600.0 * 360, rel=0.01)
    # The prior's centre scales it: ten times the prior, ten times the estimate at start.
    assert estimate_mtbf_s(0.0, 0, prior_s=36000.0) == pytest.approx(10 * estimates[0])


def _write(path: Path, events: list[dict[str, Any]]) -> None:
    with path.open("a") as f:
        for event in events:
            f.write(json.dumps(event) + "\n")


def test_failure_history_counts_attempts_across_restarts_and_relaunches(tmp_path: Path
                                                                       ) -> None:
    _write(tmp_path / "attempt000-rank0.jsonl", [
        {"event": "worker.start", "ts": 100.0}, {"event": "demo.kill", "ts": 130.0}])
    _write(tmp_path / "attempt001-rank0.jsonl", [
        {"event": "worker.start", "ts": 140.0}, {"event": "preempt.saved", "ts": 150.0}])
    # A relaunch appends to a file of the same name: a second process lifetime.
    _write(tmp_path / "attempt000-rank0.jsonl", [
        {"event": "worker.start", "ts": 200.0}, {"event": "snapshot.staged", "ts": 205.0}])
    _write(tmp_path / "attempt000-rank1.jsonl", [{"event": "worker.start", "ts": 0.0}])
    history = failure_history(tmp_path)
    assert history.failures == 2  # the preempted attempt saved its work: not a failure
    assert history.uptime_s == pytest.approx(30.0 + 10.0 + 5.0)
    assert failure_history(tmp_path / "missing") == FailureHistory()
    assert failure_history(None) == FailureHistory()


def test_failure_history_leaves_out_the_running_attempt(tmp_path: Path) -> None:
    """init() logs this process's worker.start before the manager reads the history:
    that attempt is running, not failed."""
    _write(tmp_path / "attempt000-rank0.jsonl", [
        {"event": "worker.start", "ts": 100.0, "pid": os.getpid() + 1},
        {"event": "demo.kill", "ts": 130.0}])
    _write(tmp_path / "attempt001-rank0.jsonl", [
        {"event": "worker.start", "ts": 140.0, "pid": os.getpid()}])
    assert failure_history(tmp_path) == FailureHistory(30.0, 1, memory_kept=0, unresolved=1)


def test_failure_history_tells_which_failures_kept_the_memory_tier(tmp_path: Path) -> None:
    """A failure kept the memory tier when the next attempt that resumed says so; one
    that died before resuming is settled by the next resume; the newest is unresolved
    until the running attempt's restore tells."""
    _write(tmp_path / "attempt000-rank0.jsonl", [
        {"event": "worker.start", "ts": 0.0}, {"event": "resume", "ts": 1.0},
        {"event": "x", "ts": 10.0}])
    _write(tmp_path / "attempt001-rank0.jsonl", [  # after a worker kill: memory kept
        {"event": "worker.start", "ts": 11.0}, {"event": "resume", "ts": 12.0,
                                                "memory_kept": True},
        {"event": "x", "ts": 20.0}])
    _write(tmp_path / "attempt002-rank0.jsonl", [  # died in start-up, before resuming
        {"event": "worker.start", "ts": 21.0}, {"event": "x", "ts": 22.0}])
    _write(tmp_path / "attempt003-rank0.jsonl", [  # a new node: memory lost
        {"event": "worker.start", "ts": 23.0}, {"event": "resume", "ts": 24.0,
                                                "memory_kept": False},
        {"event": "x", "ts": 30.0}])
    history = failure_history(tmp_path)
    assert history == FailureHistory(10.0 + 9.0 + 1.0 + 7.0, 4, memory_kept=1, unresolved=1)
    # The durable tier's view: only the failures that lost a node's memory (and the
    # unresolved one, until resolved).
    assert history.durable_view() == FailureHistory(27.0, 3)
    assert history.resolved(memory_kept=True).durable_view() == FailureHistory(27.0, 2)
    assert history.resolved(memory_kept=False).durable_view() == FailureHistory(27.0, 3)
    kept = history.resolved(memory_kept=True)
    assert kept.resolved(memory_kept=False) == kept


def test_failure_history_leaves_rescued_failures_out_of_the_memory_view(
        tmp_path: Path) -> None:
    """A failure whose restart resumed a rescue lost nothing: the memory interval
    leaves it out; one whose rescue was skipped counts."""
    _write(tmp_path / "attempt000-rank0.jsonl", [
        {"event": "worker.start", "ts": 0.0}, {"event": "resume", "ts": 1.0},
        {"event": "x", "ts": 10.0}])
    _write(tmp_path / "attempt001-rank0.jsonl", [  # resumed the survivor's rescue
        {"event": "worker.start", "ts": 11.0},
        {"event": "resume", "ts": 12.0, "memory_kept": True, "rescued": True},
        {"event": "x", "ts": 20.0}])
    _write(tmp_path / "attempt002-rank0.jsonl", [  # rescue skipped: a periodic snapshot
        {"event": "worker.start", "ts": 21.0},
        {"event": "resume", "ts": 22.0, "memory_kept": True, "rescued": False},
        {"event": "x", "ts": 30.0}])
    history = failure_history(tmp_path)
    assert history == FailureHistory(28.0, 3, memory_kept=2, unresolved=1, rescued=1)
    assert history.memory_view() == FailureHistory(28.0, 2)
    rescued = history.resolved(memory_kept=True, rescued=True)
    assert rescued.memory_view() == FailureHistory(28.0, 1)
    assert history.resolved(memory_kept=True, rescued=False).memory_view() == \
        FailureHistory(28.0, 2)
    assert rescued.durable_view() == FailureHistory(28.0, 0)


def test_policy_bounds_reasons_and_reevaluation() -> None:
    clock = _Clock()
    policy = IntervalPolicy(3600.0, 1.0, 600.0, FailureHistory(2000.0, 4), clock)
    with capture_logs() as logs:
        assert policy.evaluate() == 1.0  # no cost measured yet: the minimum, to measure it
        policy.observe_cost(2.0)
        assert policy.evaluate() == pytest.approx(math.sqrt(2 * 2.0 * 500.0))
        clock.now = 2000.0  # a long attempt without failures raises the MTBF estimate
        assert policy.evaluate() == pytest.approx(math.sqrt(2 * 2.0 * 1000.0))
        policy.observe_cost(1e6)
        assert policy.evaluate() == 600.0
    intervals = [e for e in logs if e["event"] == "snapshot.interval"]
    assert [e["reason"] for e in intervals] == [
        "no_cost_yet", "young_daly", "young_daly", "max_bound"]
    assert intervals[1]["cost_s"] == 2.0 and intervals[1]["mtbf_s"] == 500.0
    assert intervals[2]["mtbf_s"] == 1000.0 and intervals[1]["failures"] == 4


def test_policy_logs_only_when_the_interval_moves() -> None:
    policy = IntervalPolicy(3600.0, 1.0, 600.0, FailureHistory(), _Clock())
    policy.observe_cost(0.5)
    with capture_logs() as logs:
        for _ in range(50):
            policy.evaluate()
    assert len(logs) == 1


@pytest.mark.parametrize("field,value,needle", [
    ("every_steps", "often", "whole number of steps >= 1, 'auto' or unset"),
    ("every_steps", 2.5, "whole number of steps >= 1, 'auto' or unset"),
    ("every_steps", 0, "whole number of steps >= 1, 'auto' or unset"),
    ("every_seconds", -1, "number of seconds > 0, 'auto' or unset"),
    ("every_seconds", True, "number of seconds > 0, 'auto' or unset"),
])
def test_bad_triggers_are_one_clear_line(field: str, value: Any, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(snapshot={field: value})
    message = str(err.value)
    assert f"snapshot.{field}={value!r}" in message and needle in message
    assert "\n" not in message and message.count("fix:") == 1  # one problem, one line


def test_auto_accepted_from_the_environment_and_bounds_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTICTRAIN_SNAPSHOT__EVERY_SECONDS", "auto")
    monkeypatch.setenv("ELASTICTRAIN_SNAPSHOT__EVERY_STEPS", "AUTO")
    snap = load_settings().snapshot
    assert (snap.every_seconds, snap.every_steps, snap.auto) == ("auto", "auto", True)
    with pytest.raises(ConfigError, match=r"auto_min_interval_s=10\.0 is above"):
        load_settings(snapshot={"auto_min_interval_s": 10, "auto_max_interval_s": 5})


@pytest.mark.parametrize("trigger", ["every_steps", "every_seconds"])
def test_manager_saves_on_the_automatic_interval(tmp_path: Path, trigger: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Prior MTBF 1 s: Young/Daly is far below the 5 s minimum, so the interval is the
    bound; the first save comes at the minimum (no cost yet) and logs its reason."""
    events_dir = tmp_path / "events"
    monkeypatch.setenv("ELASTICTRAIN_LOG__EVENTS_DIR", str(events_dir))
    clock = _Clock()
    ctx = DistContext(0, 1, 0, "gloo", torch.device("cpu"), False)
    triggers: dict[str, Any] = {trigger: "auto"}
    if trigger == "every_seconds":
        triggers["every_steps"] = None
    snap = SnapshotManager(str(tmp_path / "s"), model=torch.nn.Linear(2, 2), ctx=ctx,
                           clock=clock, auto_mtbf_prior_s=1.0, auto_min_interval_s=5.0,
                           auto_max_interval_s=50.0, **triggers)
    with capture_logs() as logs:
        saved = _steps_saving(snap, clock, 16)
    snap.close()
    assert saved == [5, 10, 15]
    intervals = [e for e in logs if e["event"] == "snapshot.interval"]
    assert [e["reason"] for e in intervals] == ["no_cost_yet"]  # 5 s both ways: logged once
    assert intervals[0]["interval_steps"] == 5 and intervals[0]["interval_s"] == 5.0


def test_memory_snapshots_on_their_own_automatic_interval(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """memory_every="auto": the memory tier gets its own Young/Daly interval (logged with
    tier=memory), its first snapshot at the minimum (no cost yet); durable saves keep
    their fixed steps and restart the memory interval (they are newer)."""
    monkeypatch.setenv("ELASTICTRAIN_LOG__EVENTS_DIR", str(tmp_path / "events"))
    clock = _Clock()
    ctx = DistContext(0, 1, 0, "gloo", torch.device("cpu"), False)
    snap = SnapshotManager(str(tmp_path / "s"), model=torch.nn.Linear(2, 2), ctx=ctx,
                           clock=clock, every_steps=10, memory_every="auto",
                           memory_dir=str(tmp_path / "memory"), auto_mtbf_prior_s=1e12,
                           auto_min_interval_s=3.0, auto_max_interval_s=7.0)
    with capture_logs() as logs:
        durable = _steps_saving(snap, clock, 22)
        snap.wait()
    snap.close()
    assert durable == [10, 20]
    committed = {e["snapshot_step"] for e in logs if e["event"] == "snapshot.committed"}
    # 3 s at first (no cost yet), then the 7 s bound (a 1e12 s MTBF), counted from the
    # newest snapshot of either tier: 3, durable 10, 17, durable 20.
    assert sorted(committed - set(durable)) == [3, 17]
    intervals = [(e["tier"], e["reason"]) for e in logs if e["event"] == "snapshot.interval"]
    assert intervals == [("memory", "no_cost_yet"), ("memory", "max_bound")]


def test_manager_interval_grows_to_the_bound_with_a_long_mtbf(tmp_path: Path) -> None:
    clock = _Clock()
    ctx = DistContext(0, 1, 0, "gloo", torch.device("cpu"), False)
    snap = SnapshotManager(str(tmp_path / "s"), model=torch.nn.Linear(2, 2), ctx=ctx,
                           clock=clock, every_steps="auto", auto_mtbf_prior_s=1e12,
                           auto_min_interval_s=2.0, auto_max_interval_s=10.0)
    with capture_logs() as logs:
        saved = _steps_saving(snap, clock, 25)
    snap.close()
    assert saved == [2, 12, 22]
    reasons = [e["reason"] for e in logs if e["event"] == "snapshot.interval"]
    assert reasons == ["no_cost_yet", "max_bound"]


def test_after_a_restore_the_automatic_interval_counts_from_the_restored_step(
        tmp_path: Path) -> None:
    """Saved at 5, 10, 15; a new manager resumes at 15 and next saves at 20 (it
    counted from step 0 before: 15 steps "since the last save" in 1 s of its clock,
    a wrong step time)."""
    ctx = DistContext(0, 1, 0, "gloo", torch.device("cpu"), False)
    kw: dict[str, Any] = {"ctx": ctx, "every_steps": "auto", "auto_mtbf_prior_s": 1.0,
                          "auto_min_interval_s": 5.0, "auto_max_interval_s": 50.0}
    clock = _Clock()
    first = SnapshotManager(str(tmp_path / "s"), model=torch.nn.Linear(2, 2), clock=clock,
                            save_on_close=False, **kw)  # ends as a killed run: no final save
    _steps_saving(first, clock, 16)
    first.close()
    clock = _Clock()
    resumed = SnapshotManager(str(tmp_path / "s"), model=torch.nn.Linear(2, 2), clock=clock,
                              **kw)
    assert resumed.restore().from_step == 15
    with capture_logs() as logs:
        saved = _steps_saving(resumed, clock, 6)
    resumed.close()
    assert saved == [20]
    assert [e["interval_steps"] for e in logs if e["event"] == "snapshot.interval"] == [5]


@pytest.mark.parametrize("node_kept_memory", [True, False])
def test_durable_interval_counts_only_failures_that_lost_the_memory_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, node_kept_memory: bool) -> None:
    """An earlier attempt failed. If this node's memory directory is still there, its
    memory snapshot covers that failure: the durable interval leaves it out (prior
    rules), the memory interval counts it. A node that lost its memory directory
    (replaced, rebooted) counts it for both. The resume event says which."""
    events_dir = tmp_path / "events"
    events_dir.mkdir()
    monkeypatch.setenv("ELASTICTRAIN_LOG__EVENTS_DIR", str(events_dir))
    _write(events_dir / "attempt000-rank0.jsonl", [
        {"event": "worker.start", "ts": 0.0, "pid": os.getpid() + 1},
        {"event": "x", "ts": 50.0}])
    memory_dir = tmp_path / "memory"
    if node_kept_memory:
        memory_dir.mkdir(mode=0o700)
    ctx = DistContext(0, 1, 0, "gloo", torch.device("cpu"), False)
    snap = SnapshotManager(str(tmp_path / "s"), model=torch.nn.Linear(2, 2), ctx=ctx,
                           clock=_Clock(), every_steps="auto", memory_every="auto",
                           memory_dir=str(memory_dir))
    with capture_logs() as logs:
        snap.restore()
    resume = next(e for e in logs if e["event"] == "resume")
    assert resume["memory_kept"] is node_kept_memory
    assert snap._schedule.durable_policy is not None and snap._schedule.memory_policy is not None
    assert snap._schedule.memory_policy.history.failures == 1
    assert snap._schedule.durable_policy.history.failures == (0 if node_kept_memory else 1)
    assert snap._schedule.durable_policy.mtbf_s() == pytest.approx(
        estimate_mtbf_s(50.0, 0, 3600.0) if node_kept_memory else 50.0)
    snap.close()


