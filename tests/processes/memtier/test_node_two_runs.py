"""Issue 24, case 1: two runs on one node, with the same run id (``local``: no launcher)
and the default memory directory. Each sees only its own memory snapshots; one's
close() never removes the other's. With an explicit memory_dir both name, the second
run is refused with one line and the first's snapshots are left alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastictrain.core import layout
from tests.processes.memtier.nodejobs import Jobs, jobs, shm

pytestmark = pytest.mark.processes

__all__ = ["jobs", "shm"]


def test_second_run_never_loads_or_removes_the_first_runs_memory(tmp_path: Path,
                                                                  jobs: Jobs) -> None:
    first = jobs.start(tmp_path / "first", steps=6, park=4)
    assert first.line()["tier"] is None
    assert first.line() == {"parked": 4}
    second = jobs.start(tmp_path / "second", steps=6, park=3)
    resumed = second.line()
    assert (resumed["tier"], resumed["from_step"]) == (None, None), resumed  # not the first's
    assert second.line() == {"parked": 3}
    first.go()
    assert first.line() == {"done": 6}
    assert first.finish() == 0
    # The first run's close() removed its own memory, not the second's step 3.
    assert (Path(resumed["memory_dir"]) / layout.step_dir(3) / layout.MANIFEST).is_file()
    second.go()
    assert second.line() == {"done": 6}
    assert second.finish() == 0


def test_an_explicit_memory_dir_of_another_run_is_refused(tmp_path: Path, jobs: Jobs) -> None:
    shared = str(jobs.shm / "shared")
    first = jobs.start(tmp_path / "first", steps=6, park=4,
                       ELASTICTRAIN_SNAPSHOT__MEMORY_DIR=shared)
    assert first.line()["tier"] is None
    assert first.line() == {"parked": 4}
    second = jobs.start(tmp_path / "second", steps=6, park=3,
                        ELASTICTRAIN_SNAPSHOT__MEMORY_DIR=shared)
    assert second.finish() == 78
    refusals = [line for line in second.stderr().splitlines() if "another run" in line]
    assert len(refusals) == 1, second.stderr()
    assert (Path(shared) / layout.step_dir(4) / layout.MANIFEST).is_file()  # untouched
    first.go()
    assert first.line() == {"done": 6}
    assert first.finish() == 0
