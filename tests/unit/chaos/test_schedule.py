"""Chaos fault schedules: deterministic per seed, varied across trials, bad kinds refused."""

from __future__ import annotations

import pytest

from elastictrain.chaos.schedule import FAULT_KINDS, make_schedule, parse_kinds, trial_seed
from elastictrain.core.errors import ConfigError


def test_same_seed_and_trial_give_the_same_schedule() -> None:
    first = [make_schedule(7, t, FAULT_KINDS, 20.0, 2) for t in range(10)]
    again = [make_schedule(7, t, FAULT_KINDS, 20.0, 2) for t in range(10)]
    assert first == again
    assert make_schedule(7, 3, FAULT_KINDS, 20.0, 2) == first[3]  # replay one trial alone


def test_seeds_and_trials_give_different_schedules() -> None:
    by_trial = {make_schedule(7, t, FAULT_KINDS, 20.0, 2).describe() for t in range(20)}
    assert len(by_trial) > 10
    assert make_schedule(8, 0, FAULT_KINDS, 20.0, 2) != make_schedule(7, 0, FAULT_KINDS, 20.0, 2)
    assert trial_seed(7, 0) == trial_seed(7, 0) != trial_seed(7, 1)


def test_schedule_stays_within_kinds_horizon_and_world() -> None:
    for t in range(50):
        s = make_schedule(1, t, ("kill", "notice"), 30.0, 3)
        assert s.storage is None and 1 <= len(s.faults) <= 2
        assert all(f.kind in ("kill", "notice") and 0 < f.at_s < 30.0 and 0 <= f.rank < 3
                   for f in s.faults)
        assert [f.at_s for f in s.faults] == sorted(f.at_s for f in s.faults)
    only_storage = make_schedule(1, 0, ("storage",), 30.0, 2)
    assert only_storage.faults == () and only_storage.storage is not None


def test_every_kind_is_drawn_over_many_trials() -> None:
    kinds = {f.kind for t in range(100) for f in make_schedule(2, t, FAULT_KINDS, 10, 2).faults}
    assert kinds == {"kill", "relaunch", "notice", "stop"}
    assert any(make_schedule(2, t, FAULT_KINDS, 10, 2).storage for t in range(100))


def test_unknown_fault_kind_is_one_clear_error() -> None:
    assert parse_kinds("kill, storage") == ("kill", "storage")
    with pytest.raises(ConfigError, match=r"--faults='kill,sigkill'.*\['sigkill'\].*fix"):
        parse_kinds("kill,sigkill")


def test_two_stops_in_one_trial_stop_the_same_rank() -> None:
    """A peer must keep running for the stopped rank's hang to be found (trial 60 of
    seed 2026 on examples/ddp_resumable.py stopped both ranks and hung)."""
    from elastictrain.chaos.schedule import FAULT_KINDS, make_schedule

    doubles = 0
    for trial in range(400):
        faults = make_schedule(2026, trial, FAULT_KINDS, 10.0, 2).faults
        stops = {f.rank for f in faults if f.kind == "stop"}
        assert len(stops) <= 1, faults
        doubles += sum(f.kind == "stop" for f in faults) == 2
    assert doubles > 0  # the case was drawn and handled


def test_memory_faults_come_as_subsets_so_each_meets_a_working_memory_tier() -> None:
    """All memory kinds in every trial would put a full tmpfs beside every corruption:
    no memory snapshot would be left to corrupt."""
    from elastictrain.chaos.schedule import MEMORY_FAULTS, make_schedule

    drawn = [{f.kind for f in make_schedule(5, trial, ("kill", *MEMORY_FAULTS), 30.0, 2).memory}
             for trial in range(60)]
    assert all(drawn)  # at least one memory fault per trial
    assert set().union(*drawn) == set(MEMORY_FAULTS)
    assert any("memory_corrupt" in kinds and "shm_full" not in kinds for kinds in drawn)
    assert any(len(kinds) == len(MEMORY_FAULTS) for kinds in drawn)
    alone = make_schedule(5, 0, ("memory_corrupt",), 30.0, 2)
    assert [f.kind for f in alone.faults] == ["kill"]  # a restart meets the corrupt copy
