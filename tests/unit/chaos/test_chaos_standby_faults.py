"""The chaos faults of the standby, without processes: their kinds parse and leave every
default schedule as it was, and a pid is recycled only where the harness has a PID
namespace of its own (the real standby and workers: tests/processes/chaos/)."""
from __future__ import annotations

import os

import pytest

from elastictrain.chaos.runner import (
    in_child_pid_namespace,
    recycle_pid,
)
from elastictrain.chaos.schedule import FAULT_KINDS, make_schedule, parse_kinds


def test_standby_kinds_parse_and_leave_the_default_draws_alone() -> None:
    assert parse_kinds("standby_stop,pid_recycle") == ("standby_stop", "pid_recycle")
    for trial in range(20):
        assert make_schedule(3, trial, FAULT_KINDS, 30.0, 2).faults == make_schedule(
            3, trial, parse_kinds(",".join(FAULT_KINDS)), 30.0, 2).faults
    drawn = {f.kind for t in range(20)
             for f in make_schedule(3, t, ("standby_stop", "standby_kill"), 30.0, 2).faults}
    assert drawn == {"standby_stop", "standby_kill"}


def test_pid_recycling_is_arranged_only_in_a_pid_namespace_of_its_own() -> None:
    if in_child_pid_namespace():
        pytest.skip("runs in a PID namespace: recycling would be arranged here")
    assert recycle_pid(os.getpid()).startswith("pid recycling not arranged")


