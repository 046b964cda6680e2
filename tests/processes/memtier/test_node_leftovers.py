"""Issue 24, case 9: what a launch leaves in node memory. A relaunch of the same
training (same durable storage) under a new run id uses it; a directory no process
holds and nobody used for ``snapshot.memory_max_idle_s`` is removed by the next run of
the user on the node, one still held or recently used is not; ``elastictrain snapshots
list --memory`` shows what is held and by which run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastictrain.core.shm import LOCK
from tests.helpers import kill_session
from tests.processes.memtier.nodejobs import Jobs, jobs, shm

pytestmark = pytest.mark.processes

__all__ = ["jobs", "shm"]


def test_relaunch_with_a_new_run_id_uses_the_memory_snapshot(tmp_path: Path,
                                                              jobs: Jobs) -> None:
    first = jobs.start(tmp_path / "run", steps=8, park=5, ELASTICTRAIN_RUN_ID="first")
    first.line()
    assert first.line() == {"parked": 5}
    kill_session(first.proc)  # SIGKILL: nothing closes
    second = jobs.start(tmp_path / "run", steps=8, ELASTICTRAIN_RUN_ID="second")
    resumed = second.line()
    assert (resumed["tier"], resumed["from_step"]) == ("memory", 5)
    assert second.line() == {"done": 8}
    assert second.finish() == 0
    assert os.listdir(jobs.shm / f"elastictrain-{os.geteuid()}") == []  # close() removed it


def _parked(jobs: Jobs, root: Path, park: int) -> tuple[subprocess.Popen[bytes], Path]:
    job = jobs.start(root, steps=park + 1, park=park)
    where = Path(job.line()["memory_dir"])
    assert job.line() == {"parked": park}
    return job.proc, where


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    for p in (path, path / LOCK):
        os.utime(p, (then, then))


def test_idle_leftovers_are_removed_by_the_next_run(tmp_path: Path, jobs: Jobs) -> None:
    idle_proc, idle = _parked(jobs, tmp_path / "idle", 3)
    kill_session(idle_proc)
    live_proc, live = _parked(jobs, tmp_path / "live", 2)
    recent_proc, recent = _parked(jobs, tmp_path / "recent", 2)
    kill_session(recent_proc)
    _age(idle, 7200)
    _age(live, 7200)  # old, but a live process holds it
    listed = subprocess.run([sys.executable, "-m", "elastictrain", "snapshots", "list",
                             "--memory", "--json"], capture_output=True, check=True,
                            env={**os.environ, "ELASTICTRAIN_SHM": str(jobs.shm)})
    rows = {row["path"]: row for row in json.loads(listed.stdout)}
    assert set(rows) == {str(idle), str(live), str(recent)}
    assert rows[str(idle)]["storage"] == f"file://{tmp_path / 'idle'}"
    # Newest first; step 2 may not be pruned yet when the rank parked after step 3.
    assert rows[str(idle)]["steps"].split(",")[0] == "3" and not rows[str(idle)]["in_use"]
    assert rows[str(live)]["in_use"] is True
    nxt = jobs.start(tmp_path / "next", steps=1)
    assert nxt.line()["tier"] is None
    assert nxt.line() == {"done": 1}
    assert nxt.finish() == 0
    assert not idle.exists()
    assert live.is_dir() and recent.is_dir()
    kill_session(live_proc)
