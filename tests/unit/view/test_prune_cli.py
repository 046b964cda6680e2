"""``elastictrain snapshots prune``: every step deleted and kept is listed, ``--dry-run``
deletes nothing, and the rows are the only output (no log lines on stderr)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastictrain.cli import main
from elastictrain.snapshot.format.reader import list_snapshot_dirs
from elastictrain.storage import open_store
from tests.small_job import build, train

# main() points the log at the test's captured stderr: undone after each test.
pytestmark = pytest.mark.usefixtures("logging_reset")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    parts = build(str(root), every_steps=2, keep=5)
    train(*parts, until=8)
    parts[4].close()
    assert list_snapshot_dirs(open_store(str(root))) == [8, 6, 4, 2]
    return root


def _rows(out: str) -> list[str]:
    return [line.split("  path=")[0] for line in out.splitlines()]


def test_a_dry_run_lists_what_would_go_and_deletes_nothing(
        run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["snapshots", "prune", str(run_dir), "--keep", "2", "--dry-run"])
    out, err = capsys.readouterr()
    assert info.value.code == 0 and err == ""
    assert _rows(out) == ["step=4  status=would delete (retention)",
                          "step=2  status=would delete (retention)",
                          "step=8  status=kept (newest verified)", "step=6  status=kept"]
    assert list_snapshot_dirs(open_store(str(run_dir))) == [8, 6, 4, 2]


def test_prune_lists_every_step_deleted_and_kept(
        run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["snapshots", "prune", str(run_dir), "--keep", "2"])
    out, err = capsys.readouterr()
    assert info.value.code == 0 and err == ""  # no snapshot.pruned log lines
    assert _rows(out) == ["step=4  status=deleted (retention)",
                          "step=2  status=deleted (retention)",
                          "step=8  status=kept (newest verified)", "step=6  status=kept"]
    assert list_snapshot_dirs(open_store(str(run_dir))) == [8, 6]
