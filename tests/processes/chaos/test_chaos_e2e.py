"""``elastictrain chaos`` end to end on the demo: a clean run, then two seeded trials of
real faults (SIGKILL by PID, job kill + relaunch, notices, storage faults) that pass."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.helpers import run_cli, started, wait_for

pytestmark = pytest.mark.distributed  # the demo under elastictrain run


def processes_mentioning(path: Path) -> list[int]:
    """Live processes whose environment names ``path`` (every process of a trial has
    its TMPDIR there)."""
    needle = str(path).encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_chaos_two_trials_on_the_demo_pass(tmp_path: Path) -> None:
    work = tmp_path / "chaos"
    result = run_cli(["chaos", "--trials", "2", "--seed", "1", "--steps", "30",
                      "--snapshot-every", "10", "--storage", str(work), "--json"],
                     tmp_path, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["passed"] and report["clean_digest"] and report["interval"] == 10
    trials = report["trials"]
    assert [t["trial"] for t in trials] == [0, 1]
    for trial in trials:
        assert trial["failures"] == [] and trial["exit_codes"][-1] == 0
        injected = [i for i in trial["injected"] if "not injected" not in i]
        assert injected or trial["storage_faults_injected"], trial
    # Seed 1 draws a job kill + relaunch in trial 0 and a notice in trial 1.
    assert any(i.startswith("relaunch") for i in trials[0]["injected"])
    assert any(i.startswith("notice") for i in trials[1]["injected"])
    assert "replay: --seed 1 --first 1 --trials 1" in result.stderr
    assert "chaos-secret-" not in result.stdout + result.stderr  # the planted credential
    assert processes_mentioning(work) == []


def test_chaos_memory_and_standby_faults_on_the_demo_pass(tmp_path: Path) -> None:
    """The faults of a shared node, with the memory tier on: a second run sharing the
    default memory root, a memory snapshot corrupted on disk, the tmpfs filling up (a
    small tmpfs of the trial's own: root only), the standby SIGKILLed with a worker.
    Each trial also checks that no file of the run in node memory is open to other
    users and that nothing of it is left there at the end."""
    work = tmp_path / "chaos"
    result = run_cli(["chaos", "--trials", "2", "--seed", "7", "--steps", "30",
                      "--snapshot-every", "10", "--storage", str(work), "--json",
                      "--faults", "kill,shm_neighbour,shm_full,memory_corrupt,standby_kill"],
                     tmp_path, timeout=500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    trials = json.loads(result.stdout)["trials"]
    assert all(t["failures"] == [] and t["exit_codes"][-1] == 0 for t in trials), trials
    injected = " ".join(i for t in trials for i in t["injected"])
    # Seed 7 draws memory_corrupt + shm_neighbour + a kill in trial 0, and shm_full +
    # memory_corrupt + two standby kills in trial 1.
    assert "memory_corrupt: payload of step(s)" in " ".join(trials[0]["injected"])
    assert "shm_neighbour: second run" in injected
    assert "standby_kill: SIGKILL standby" in injected
    assert ("shm_full: filler of" if os.geteuid() == 0 else "shm_full not injected") in injected
    assert processes_mentioning(work) == []


def test_sigterm_stops_the_harness_and_every_process_it_started(tmp_path: Path) -> None:
    """A scheduler's SIGTERM to ``elastictrain chaos`` in the middle of a run: it exits
    143 and leaves no launcher, standby or worker behind."""
    work = tmp_path / "chaos"
    cmd = [sys.executable, "-m", "elastictrain.cli", "chaos", "--trials", "1", "--steps",
           "2000", "--storage", str(work)]
    with started(cmd, tmp_path, "chaos.log") as chaos:
        wait_for(lambda: len(processes_mentioning(work)) >= 3, 180,
                 "the clean run's launcher, standby and workers")
        chaos.send_signal(signal.SIGTERM)
        code = chaos.wait(timeout=120)
    left = processes_mentioning(work)
    for pid in left:  # never leak them, whatever the assertion says
        os.kill(pid, signal.SIGKILL)
    assert code == 128 + signal.SIGTERM, (tmp_path / "chaos.log").read_text()[-3000:]
    assert left == []
