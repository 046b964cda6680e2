"""Events follow the storage the script passes to SnapshotManager (session.events_beside):
the file init() opened under storage.url moves there with what it holds, the empty
default directory goes away; a configured log.events_dir stays; on object storage
the file is spooled locally and uploaded under <storage>/events/<run id>/."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastictrain.core import log as et_log
from elastictrain.core.config import StorageConfig, load_settings
from elastictrain.core.localfiles import user_dir_name
from elastictrain.runlog import events
from elastictrain.runlog.events_read import parse_event_lines, read_events
from elastictrain.storage import open_store
from elastictrain.worker import session

NAME = "attempt000-20250101T000000Z-abcd-rank0.jsonl"


def _runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **log: str) -> session.Runtime:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ELASTICTRAIN_LAUNCH_ID", raising=False)
    settings = load_settings(log=log) if log else load_settings()
    sink = events.open_sink(settings, "r1", NAME)
    et_log.configure("info", json_output=True, events_file=sink.path)
    et_log.get_logger().info("worker.start", pid=1)
    rt = session.Runtime.__new__(session.Runtime)
    rt.settings, rt.events_dir, rt.run_id = settings, str(sink.path.parent), "r1"
    rt.events_file_name, rt.events_moved, rt.finished = NAME, False, False
    monkeypatch.setattr(session, "_current", rt)
    return rt


@pytest.fixture(autouse=True)
def _reset_log() -> Iterator[None]:
    yield
    et_log.configure("info", json_output=True, events_file=None)


def test_the_file_moves_beside_the_snapshots(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    old = os.umask(0o022)
    try:
        _moves_beside(tmp_path, monkeypatch)
    finally:
        os.umask(old)


def _moves_beside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _runtime(tmp_path, monkeypatch)
    assert (tmp_path / "elastictrain-run" / "events" / "r1" / NAME).exists()
    session.events_beside(StorageConfig(url=str(tmp_path / "ckpt")), "r1")
    et_log.get_logger().info("resume", from_step=None)
    moved = tmp_path / "ckpt" / "events" / "r1" / NAME
    assert rt.events_dir == str(moved.parent)
    assert [e["event"] for e in read_events(moved)] == ["worker.start", "resume"]
    assert not (tmp_path / "elastictrain-run").exists()
    # Private as every event file this user's processes create (docs/memory-tier.md),
    # under the umask a shell gives (0022), in directories it created.
    assert stat.S_IMODE(moved.stat().st_mode) == 0o600
    assert {stat.S_IMODE(d.stat().st_mode) for d in (moved.parent, moved.parent.parent)} == {0o700}
    session.events_beside(StorageConfig(url=str(tmp_path / "other")), "r1")  # the first decides
    assert not (tmp_path / "other").exists()


def test_a_configured_events_dir_stays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _runtime(tmp_path, monkeypatch, events_dir=str(tmp_path / "ev"))
    session.events_beside(StorageConfig(url=str(tmp_path / "ckpt")), "r1")
    assert rt.events_dir == str(tmp_path / "ev") and (tmp_path / "ev" / NAME).exists()
    assert not (tmp_path / "ckpt").exists()


def test_object_storage_gets_the_file_uploaded(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _runtime(tmp_path, monkeypatch)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # the local spool
    url = "memory://events-beside-test"
    session.events_beside(StorageConfig(url=url), "r1")
    et_log.get_logger().info("resume", from_step=None)
    et_log.configure("info", json_output=True, events_file=None)  # closing the file uploads it
    uploaded = open_store(url).read_bytes(f"events/r1/{NAME}").decode()
    assert [e["event"] for e in parse_event_lines(uploaded)] == ["worker.start",
                                                                      "resume"]
    spool = tmp_path / "tmp" / user_dir_name("elastictrain-events")  # per user
    assert (spool / "r1" / NAME).exists()


def test_a_relaunch_joins_the_run_its_storage_holds_and_points_its_launcher_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The storage's run id (runlog/run_marker.py) replaces this launch's own: the file
    goes under it and later events carry it; under elastictrain run the launcher's
    directory gets a pointer to where its workers' events went (launcher/gather.py)."""
    rt = _runtime(tmp_path, monkeypatch)
    monkeypatch.setenv("ELASTICTRAIN_LAUNCH_ID", "20250101T000000Z-abcd")
    old_dir = Path(rt.events_dir or "")
    session.events_beside(StorageConfig(url=str(tmp_path / "ckpt")), "job-0")
    et_log.get_logger().info("resume", from_step=3)
    moved = tmp_path / "ckpt" / "events" / "job-0" / NAME
    assert rt.run_id == "job-0" and rt.events_dir == str(moved.parent)
    assert [e.get("run_id") for e in read_events(moved)][-1] == "job-0"
    assert (old_dir / NAME).is_symlink()  # the launcher's view still reads it
    pointer = events.read_moved_to(old_dir, "20250101T000000Z-abcd")
    assert pointer == events.MovedTo(str(tmp_path / "ckpt"), "job-0", str(moved.parent))
