"""The launcher's directory for its workers' end marks (handoff/end_marks.py): private, held
while the launcher runs, removed after; one left by a launcher that was SIGKILLed is
removed by the next launch of the same user, never one a live launcher holds."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from elastictrain.handoff import end_marks


@pytest.fixture
def tmpdir_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_dead_launchers_directory_goes_a_live_ones_stays(tmpdir_here: Path) -> None:
    left = tmpdir_here / f"{end_marks.END_DIR_PREFIX}killed"  # nobody holds it
    left.mkdir(mode=0o700)
    (left / "ended-123").touch()
    foreign = tmpdir_here / f"{end_marks.END_DIR_PREFIX}link"
    foreign.symlink_to(tmpdir_here)  # not a directory of ours: never followed
    with end_marks.end_dir() as mine:
        assert not left.exists() and foreign.is_symlink()
        assert stat.S_IMODE(mine.stat().st_mode) == 0o700
        assert mine.name.startswith(end_marks.END_DIR_PREFIX)
        assert end_marks.sweep_end_dirs(tmpdir_here) == []  # held: a second launcher's sweep
        with end_marks.end_dir() as other:  # a second launcher at once
            assert mine.is_dir() and other.is_dir() and other != mine
    assert not mine.exists() and not other.exists()
    assert os.listdir(tmpdir_here) == [foreign.name]
