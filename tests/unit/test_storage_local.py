"""FsspecStore on local disk and memory://: atomic writes, fresh listings, error translation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elastictrain.errors import StorageError, StorageNotFoundError, StoragePermissionError
from elastictrain.storage import open_store, redact_url


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    if request.param == "local":
        yield open_store(str(tmp_path / "root"))
        return
    s = open_store(f"memory://et-{os.getpid()}-{id(request)}")
    yield s
    s.delete("", recursive=True)


def test_write_read_list_delete(store) -> None:  # type: ignore[no-untyped-def]
    store.write_bytes("a/b.bin", b"hello")
    with store.open_write("a/c.bin") as f:
        f.write(b"x" * 10)
    assert store.read_bytes("a/b.bin") == b"hello"
    assert store.list_dir("a") == ["b.bin", "c.bin"]
    assert store.size("a/c.bin") == 10 and store.exists("a/c.bin")
    store.delete("a", recursive=True)
    assert store.list_dir("a") == [] and not store.exists("a/b.bin")


def test_if_absent_refuses_to_clobber(store) -> None:  # type: ignore[no-untyped-def]
    store.write_bytes("m.json", b"first", if_absent=True)
    with pytest.raises(StorageError, match="already exists"):
        store.write_bytes("m.json", b"second", if_absent=True)
    assert store.read_bytes("m.json") == b"first"


def test_missing_object_is_storage_not_found(store) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(StorageNotFoundError, match="not found; fix"):
        store.read_bytes("nope.bin")


def test_local_atomic_write_leaves_no_temp_files(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    store.write_bytes("x.bin", b"1")
    store.write_bytes("x.bin", b"2")
    assert sorted(os.listdir(tmp_path)) == ["x.bin"] and store.read_bytes("x.bin") == b"2"


def test_rename_commits_directory(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    store.write_bytes("tmpdir/f", b"1")
    store.rename("tmpdir", "final")
    assert store.list_dir("") == ["final"] and store.read_bytes("final/f") == b"1"


def test_denied_write_is_permission_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests run as root, which ignores mode bits, so the OS denial is simulated.
    from elastictrain.storage import fsspec_store

    def deny(full: str, data: bytes, if_absent: bool) -> None:
        raise PermissionError(13, "Permission denied", full)

    monkeypatch.setattr(fsspec_store, "_local_atomic_write", deny)
    with pytest.raises(StoragePermissionError, match="permission denied; fix") as info:
        open_store(str(tmp_path / "ro")).check_writable()
    assert str(tmp_path / "ro") in str(info.value)


def test_unwritable_location_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError, match=str(blocker)):
        open_store(str(blocker / "sub")).check_writable()


def test_redact_url_drops_credentials() -> None:
    assert redact_url("s3://AKIA:secret@bucket/run") == "s3://bucket/run"
    assert "secret" not in repr(open_store("memory://user:secret@bucket"))
