"""``elastictrain snapshots`` messages through ``ops``: a partial step never committed,
many steps newest first and cut short, an empty run, an invalid manifest is corrupt, a
mistyped URL never shows a credential (the real CLI as a child:
tests/processes/cli/test_snapshot_cli_messages_run.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastictrain.core import layout
from elastictrain.core.errors import ConfigError, SnapshotCorrupt
from elastictrain.storage import open_store
from elastictrain.storage.locations import check_location
from elastictrain.view import ops
from tests.planted import plant_snapshot

PARTIAL_STEP = 15
def _run_root(tmp_path: Path) -> Path:
    """Committed snapshots of steps 5 and 10, and a step-15 directory with no manifest."""
    root = tmp_path / "run"
    store = open_store(str(root))
    for step in (5, 10):
        plant_snapshot(store, step, {"w": torch.ones(4)})
    (root / layout.step_dir(PARTIAL_STEP)).mkdir()
    return root


def test_inspect_of_a_partial_step_says_it_never_committed(tmp_path: Path) -> None:
    store = open_store(str(_run_root(tmp_path)))
    with pytest.raises(SnapshotCorrupt, match=r"step 15 is partial: .*no MANIFEST\.json, "
                       r"so it never committed"):
        ops.inspect_snapshot(store, PARTIAL_STEP)


def test_many_steps_are_listed_newest_first_and_cut_short(tmp_path: Path) -> None:
    root = tmp_path / "run"
    for step in range(1, 15):
        (root / layout.step_dir(step)).mkdir(parents=True)
    with pytest.raises(ConfigError) as info:
        ops.verify_snapshots(open_store(str(root)), 99)
    message = str(info.value)
    assert "newest first: 14 (partial), 13 (partial)" in message
    assert "5 (partial) and 4 older;" in message and ", 4 (partial)" not in message


def test_a_missing_step_in_an_empty_run_says_there_are_none(tmp_path: Path) -> None:
    (tmp_path / "run" / "snapshots").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"no snapshot of step 3 .*: there are no snapshots"):
        ops.inspect_snapshot(open_store(str(tmp_path / "run")), 3)


def test_an_invalid_manifest_is_corrupt_not_partial(tmp_path: Path) -> None:
    root = _run_root(tmp_path)
    (root / layout.step_dir(10) / layout.MANIFEST).write_text("{not json")
    store = open_store(str(root))
    assert [(r["step"], r["status"]) for r in ops.list_snapshots(store)] == [
        (15, "partial"), (10, "corrupt"), (5, "unverified")]
    assert [(r["step"], r["status"]) for r in ops.verify_snapshots(store)] == [
        (15, "partial"), (10, "corrupt"), (5, "ok")]


def test_a_mistyped_url_never_shows_a_credential() -> None:
    with pytest.raises(ConfigError) as info:
        check_location("s3//AKIAX:hunter2@bucket/run")
    assert "hunter2" not in str(info.value) and "s3://bucket/run" in str(info.value)


