"""Issue 24, case 2: a memory directory that overlaps the durable storage (inside it,
or holding it) is refused with one line and exit 78, before anything is written or
pruned."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.processes.memtier.nodejobs import Jobs, jobs, shm

pytestmark = pytest.mark.processes

__all__ = ["jobs", "shm"]


@pytest.mark.parametrize("where", ["inside", "around"])
def test_memory_dir_overlapping_durable_storage_is_refused(tmp_path: Path, jobs: Jobs,
                                                           where: str) -> None:
    root = tmp_path / "run"
    root.mkdir()
    (root / "keep-me").write_text("a user's file beside the snapshots")
    memory_dir = root / "snapshots" if where == "inside" else tmp_path
    job = jobs.start(root, steps=4, ELASTICTRAIN_SNAPSHOT__MEMORY_DIR=str(memory_dir))
    assert job.finish() == 78
    refusals = [line for line in job.stderr().splitlines() if "overlaps" in line]
    assert len(refusals) == 1, job.stderr()
    # Nothing of the tiers was written (the worker's events live beside the snapshots).
    assert sorted(p.name for p in root.iterdir() if p.name != "events") == ["keep-me"]
    assert (root / "keep-me").read_text() == "a user's file beside the snapshots"
