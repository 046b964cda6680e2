"""``elastictrain chaos`` end to end on the demo: a clean run, then three seeded trials of
real faults (SIGKILL by PID, job kill + relaunch, notices, stopped workers, storage
faults, the faults of a shared node and of the standby) that pass."""

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


def test_chaos_three_trials_on_the_demo_pass(tmp_path: Path) -> None:
    """A clean run, then three seeded trials drawing from every process fault and the
    faults of a shared node, with the memory tier on: a second run sharing the default
    memory root, a memory snapshot corrupted on disk, the tmpfs filling up (a small tmpfs
    of the trial's own: root only), the standby SIGKILLed. Each trial also checks that no
    file of the run in node memory is open to other users and that nothing of it is left
    there at the end."""
    work = tmp_path / "chaos"
    result = run_cli(["chaos", "--trials", "3", "--seed", "555", "--steps", "30",
                      "--snapshot-every", "10", "--storage", str(work), "--json",
                      "--faults", "kill,relaunch,notice,stop,storage,shm_neighbour,shm_full,"
                      "memory_corrupt,standby_kill"], tmp_path, timeout=500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["passed"] and report["clean_digest"] and report["interval"] == 10
    trials = report["trials"]
    assert [t["trial"] for t in trials] == [0, 1, 2]
    for trial in trials:
        assert trial["failures"] == [] and trial["exit_codes"][-1] == 0, trial
        injected = [i for i in trial["injected"] if "not injected" not in i]
        assert injected or trial["storage_faults_injected"], trial
    # Seed 555 draws a notice and a corrupted memory snapshot in trial 0; a second run on
    # the node, a full tmpfs, a corrupted memory snapshot, a standby kill and storage
    # faults in trial 1; a job kill + relaunch in trial 2.
    first, second, third = (" ".join(t["injected"]) for t in trials)
    assert "notice" in first and "memory_corrupt: payload of step(s)" in first
    assert "shm_neighbour: second run" in second and "standby_kill: SIGKILL standby" in second
    assert ("shm_full: filler of" if os.geteuid() == 0 else "shm_full not injected") in second
    assert "relaunch" in third
    assert "replay: --seed 555 --first 2 --trials 1" in result.stderr
    assert "chaos-secret-" not in result.stdout + result.stderr  # the planted credential
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
