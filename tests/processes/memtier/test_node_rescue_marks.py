"""Issue 24, case 12: a survivor is seen as rescuing (its ``rescuing-<pid>`` mark, the
agent's signal to wait) from before it takes the rescue lock or waits for a memory save
in flight; and a rescuer killed half-way leaves no lock that would stop another."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastictrain.handoff.rescue_marks import rescuing_pids
from elastictrain.snapshot.memory import rescue
from tests.helpers import REPO, child_env, kill_session

pytestmark = pytest.mark.processes

JOB = REPO / "tests" / "processes" / "memtier" / "rescue_wait_job.py"
ATTEMPT = (1, 0, -1)  # one process, first attempt, fresh start


@pytest.fixture
def rescuer(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = child_env(tmp_path, PYTHONPATH=str(REPO))
    env.pop("ELASTICTRAIN_RESCUE_MARKS", None)
    proc = subprocess.Popen([sys.executable, str(JOB), str(tmp_path / "run"),
                             str(tmp_path / "mem")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, cwd=tmp_path, env=env,
                            start_new_session=True)
    try:
        yield proc
    finally:
        kill_session(proc)
        for pipe in (proc.stdin, proc.stdout):
            assert pipe is not None
            pipe.close()


def test_the_agent_sees_a_rescue_waiting_for_a_save_in_flight(
        tmp_path: Path, rescuer: subprocess.Popen[bytes]) -> None:
    assert rescuer.stdout is not None and rescuer.stdin is not None
    assert rescuer.stdout.readline() == b"waiting\n"  # inside the rescue, before it saves
    marks = tmp_path / "mem" / rescue.BOUNDARY_DIR
    assert rescuer.pid in rescuing_pids(marks)
    rescuer.stdin.write(b"go\n")
    rescuer.stdin.flush()
    assert rescuer.stdout.readline() == b"done\n"
    assert rescuer.wait(timeout=60) == 0
    assert rescuing_pids(marks) == set()
    assert rescue.was_rescued(marks, 2)


def test_a_rescuer_killed_half_way_leaves_no_lock(
        tmp_path: Path, rescuer: subprocess.Popen[bytes]) -> None:
    assert rescuer.stdout is not None
    assert rescuer.stdout.readline() == b"waiting\n"  # it holds the lock now
    marks = tmp_path / "mem" / rescue.BOUNDARY_DIR
    assert not rescue.take_lock(marks, ATTEMPT, 2)
    kill_session(rescuer)  # what the agent does after launch.rescue_timeout_s
    assert rescue.take_lock(marks, ATTEMPT, 2)  # another rank may rescue now
