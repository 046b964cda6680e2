"""Issue 24, case 6: what a run keeps in node memory is its user's alone. Directories
0700 and files 0600 (snapshots, identity, lock, boundary records); another real Unix
user can read none of it; a memory directory that is a symlink or another user's, or a
per-user root another user planted, is refused with one line (exit 78); and one user's
directory never blocks another user's memory tier."""

from __future__ import annotations

import os
import stat
import subprocess
import uuid
from pathlib import Path

import pytest

from elastictrain.core import layout
from tests.processes.memtier.nodejobs import Jobs, jobs, shm, stats_under

__all__ = ["jobs", "shm"]

OTHER = "etother"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: runs as a second "
                                "Unix user (useradd etother)")


@pytest.fixture(autouse=True)
def other_user() -> None:
    if subprocess.run(["id", OTHER], capture_output=True).returncode != 0:
        # Another xdist worker may add it at the same moment: "already exists" is fine.
        subprocess.run(["useradd", "-m", OTHER], capture_output=True, check=False)
    assert subprocess.run(["id", OTHER], capture_output=True).returncode == 0, "useradd failed"


def as_other(*cmd: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["runuser", "-u", OTHER, "--", *cmd], capture_output=True)


@pytest.mark.processes
def test_memory_files_are_private_to_the_user(tmp_path: Path, jobs: Jobs) -> None:
    memory_dir = jobs.shm / "mine"
    job = jobs.start(tmp_path / "run", steps=4, park=3,
                     ELASTICTRAIN_SNAPSHOT__MEMORY_DIR=str(memory_dir))
    job.line()
    assert job.line() == {"parked": 3}
    stats = stats_under(memory_dir)
    payload = memory_dir / layout.step_dir(3) / layout.PAYLOAD
    assert payload in stats and (memory_dir / "boundary" / "rank0") in stats
    loose = {str(p): oct(stat.S_IMODE(st.st_mode)) for p, st in stats.items()
             if stat.S_IMODE(st.st_mode) != (0o700 if stat.S_ISDIR(st.st_mode) else 0o600)}
    assert not loose, loose
    assert as_other("cat", str(payload)).returncode != 0
    assert as_other("ls", str(memory_dir)).returncode != 0
    job.go()
    assert job.line() == {"done": 4}
    assert job.finish() == 0


@pytest.mark.processes
@pytest.mark.parametrize("plant", ["symlink", "others_dir"])
def test_a_planted_memory_dir_is_refused(tmp_path: Path, jobs: Jobs, plant: str) -> None:
    victim = tmp_path / "victim"  # say, another run's durable root
    (victim / "snapshots").mkdir(parents=True)
    memory_dir = jobs.shm / "planted"
    if plant == "symlink":
        memory_dir.symlink_to(victim)
    else:
        assert as_other("mkdir", "-m", "777", str(memory_dir)).returncode == 0
    job = jobs.start(tmp_path / "run", steps=3, ELASTICTRAIN_SNAPSHOT__MEMORY_DIR=str(memory_dir))
    assert job.finish() == 78
    refusals = [line for line in job.stderr().splitlines() if str(memory_dir) in line]
    assert len(refusals) == 1, job.stderr()
    assert os.listdir(victim / "snapshots") == []
    if plant == "others_dir":
        assert os.listdir(memory_dir) == []


@pytest.mark.processes
def test_another_users_planted_root_is_refused(tmp_path: Path,
                                                                jobs: Jobs) -> None:
    # The other user planted this user's default root: refused, nothing written there.
    planted = jobs.shm / f"elastictrain-{os.geteuid()}"
    assert as_other("mkdir", "-m", "777", str(planted)).returncode == 0
    job = jobs.start(tmp_path / "run", steps=3)
    assert job.finish() == 78
    assert len([ln for ln in job.stderr().splitlines() if str(planted) in ln]) == 1
    assert os.listdir(planted) == []


@pytest.mark.processes
def test_one_users_memory_root_never_blocks_anothers(tmp_path: Path, jobs: Jobs) -> None:
    mine = jobs.start(tmp_path / "run", steps=3, park=2)
    assert mine.line()["memory_dir"].startswith(str(jobs.shm / f"elastictrain-{os.geteuid()}"))
    assert mine.line() == {"parked": 2}
    theirs_root = Path("/tmp") / f"et-other-{uuid.uuid4().hex[:12]}"  # unique on the machine
    assert as_other("mkdir", "-p", str(theirs_root)).returncode == 0
    try:
        theirs = jobs.start(theirs_root / "run", steps=2, user=OTHER, cwd=theirs_root,
                            HOME=f"/home/{OTHER}", TMPDIR=str(theirs_root))
        said = theirs.line()
        assert said["memory_dir"].startswith(str(jobs.shm / "elastictrain-"))
        assert said["memory_dir"] != str(jobs.shm / f"elastictrain-{os.geteuid()}")
        assert theirs.line() == {"done": 2}
        assert theirs.finish() == 0
    finally:
        subprocess.run(["rm", "-rf", str(theirs_root)], check=False)
    mine.go()
    assert mine.line() == {"done": 3}
    assert mine.finish() == 0
