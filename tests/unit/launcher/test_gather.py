"""At the end of a launch its own files join the run's (launcher/gather.py): moved beside
the workers' events on local storage, uploaded on object storage (``memory://`` stands
for S3: the same code path), the default directory removed once empty; a directory the
user named, a launch whose workers moved nothing, and a failed upload are left alone."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from elastictrain.core.config import load_settings
from elastictrain.launcher.gather import gather
from elastictrain.runlog.events import MovedTo, moved_to_name, write_moved_to
from elastictrain.storage import open_store
from elastictrain.view.run import RunOutput

pytestmark = pytest.mark.usefixtures("logging_reset")

LAUNCH = "20261129T120000Z-abcd"


def _launch(tmp_path: Path, storage: str, target: Path) -> Path:
    """A launcher's default events directory as a run leaves it, and the workers' files."""
    launcher_dir = tmp_path / "elastictrain-run" / "events" / "et-x"
    logs = launcher_dir / "torchelastic" / LAUNCH / "et-x_q1" / "attempt_0" / "0"
    logs.mkdir(parents=True)
    (logs / "stdout.log").write_text("hello from rank 0\n")
    (launcher_dir / f"agent-{LAUNCH}-host-1.jsonl").write_text('{"event":"agent.start"}\n')
    (launcher_dir / f"launcher-{LAUNCH}.log").write_text("launcher output\n")
    target.mkdir(parents=True, exist_ok=True)
    worker = target / f"attempt000-{LAUNCH}-rank0.jsonl"
    worker.write_text('{"event":"worker.start"}\n')
    (launcher_dir / worker.name).symlink_to(worker)
    write_moved_to(launcher_dir, LAUNCH, MovedTo(storage, "job-1", str(target)))
    return launcher_dir


def test_local_files_move_beside_the_workers_and_the_default_directory_goes(
        tmp_path: Path) -> None:
    target = tmp_path / "ckpt" / "events" / "job-1"
    launcher_dir = _launch(tmp_path, str(tmp_path / "ckpt"), target)
    output = RunOutput(launcher_dir, str(launcher_dir / "torchelastic" / LAUNCH),
                       launcher_dir / f"launcher-{LAUNCH}.log")
    gathered = gather(launcher_dir, LAUNCH, load_settings())
    assert gathered is not None and gathered.location == str(target)
    assert sorted(os.listdir(target)) == sorted([
        f"agent-{LAUNCH}-host-1.jsonl", f"attempt000-{LAUNCH}-rank0.jsonl",
        f"launcher-{LAUNCH}.log", "torchelastic"])
    assert (target / f"torchelastic/{LAUNCH}/et-x_q1/attempt_0/0/stdout.log").read_text() == \
        "hello from rank 0\n"
    assert not (target / f"attempt000-{LAUNCH}-rank0.jsonl").is_symlink()
    assert not (tmp_path / "elastictrain-run").exists()
    moved = gathered.output_of(launcher_dir, output)
    assert moved.worker_logs == f"{target}/torchelastic/{LAUNCH}"
    assert moved.launcher_log == f"{target}/launcher-{LAUNCH}.log"


def test_another_launch_sharing_the_directory_keeps_its_files(tmp_path: Path) -> None:
    """Two agents on one machine share the launcher directory: each takes its own."""
    target = tmp_path / "ckpt" / "events" / "job-1"
    launcher_dir = _launch(tmp_path, str(tmp_path / "ckpt"), target)
    other = "20261129T120005Z-ef01"
    (launcher_dir / "torchelastic" / other).mkdir()
    (launcher_dir / f"agent-{other}-host-2.jsonl").write_text("{}\n")
    worker = target / f"attempt000-{other}-rank1.jsonl"
    worker.write_text("{}\n")
    (launcher_dir / worker.name).symlink_to(worker)
    assert gather(launcher_dir, LAUNCH, load_settings()) is not None
    assert sorted(os.listdir(launcher_dir)) == [f"agent-{other}-host-2.jsonl",
                                                worker.name, "torchelastic"]
    assert os.listdir(launcher_dir / "torchelastic") == [other]


def test_a_directory_the_user_named_and_a_launch_without_pointer_stay(tmp_path: Path) -> None:
    target = tmp_path / "ckpt" / "events" / "job-1"
    launcher_dir = _launch(tmp_path, str(tmp_path / "ckpt"), target)
    named = load_settings(log={"events_dir": str(launcher_dir)})
    assert gather(launcher_dir, LAUNCH, named) is None
    (launcher_dir / moved_to_name(LAUNCH)).unlink()
    assert gather(launcher_dir, LAUNCH, load_settings()) is None
    assert (launcher_dir / f"launcher-{LAUNCH}.log").exists()


def test_object_storage_gets_the_files_uploaded(tmp_path: Path) -> None:
    url = f"memory://gather-{uuid.uuid4().hex[:8]}/run"
    spool = tmp_path / "spool" / "job-1"
    launcher_dir = _launch(tmp_path, url, spool)
    gathered = gather(launcher_dir, LAUNCH, load_settings())
    store = open_store(url)
    try:
        assert gathered is not None and gathered.remote
        assert gathered.location.endswith("/run/events/job-1")
        assert store.read_bytes(f"events/job-1/launcher-{LAUNCH}.log") == b"launcher output\n"
        assert store.read_bytes(
            f"events/job-1/torchelastic/{LAUNCH}/et-x_q1/attempt_0/0/stdout.log"
        ) == b"hello from rank 0\n"
        assert not store.exists(f"events/job-1/attempt000-{LAUNCH}-rank0.jsonl")  # a link
        assert not (tmp_path / "elastictrain-run").exists()
    finally:
        store.delete("", recursive=True)


def test_a_failed_upload_keeps_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    from elastictrain.core.errors import StorageError
    from elastictrain.launcher import gather as gather_module

    class Refusing:
        url = "memory://refusing"

        def write_bytes(self, *_args: object, **_kwargs: object) -> None:
            raise StorageError("access denied")

    monkeypatch.setattr(gather_module, "open_store", lambda *_a, **_k: Refusing())
    launcher_dir = _launch(tmp_path, "memory://refusing/run", tmp_path / "spool")
    assert gather(launcher_dir, LAUNCH, load_settings()) is None
    assert (launcher_dir / f"launcher-{LAUNCH}.log").exists()
