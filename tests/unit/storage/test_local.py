"""Local disk specifics beyond the contract: atomic replace, rename commits, OS errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elastictrain.core.errors import StorageError, StoragePermissionError
from elastictrain.storage import open_store, redact_url


def test_local_atomic_write_leaves_no_temp_files(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    store.write_bytes("x.bin", b"1")
    store.write_bytes("x.bin", b"2")
    with store.open_write("y.bin") as f:
        f.write(b"3")
    assert sorted(os.listdir(tmp_path)) == ["x.bin", "y.bin"]
    assert store.read_bytes("x.bin") == b"2"


def test_failed_stream_keeps_the_previous_object(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    store.write_bytes("x.bin", b"old")
    with pytest.raises(RuntimeError), store.open_write("x.bin") as f:
        f.write(b"new, half written")
        raise RuntimeError("crash")
    assert store.read_bytes("x.bin") == b"old" and os.listdir(tmp_path) == ["x.bin"]


def test_rename_commits_directory(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    store.write_bytes("tmpdir/f", b"1")
    store.rename("tmpdir", "final")
    assert store.list_dir("") == ["final"] and store.read_bytes("final/f") == b"1"


def test_denied_write_is_permission_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests run as root, which ignores mode bits, so the OS denial is simulated.
    from elastictrain.storage import local

    def deny(full: str, data: bytes, **_: object) -> None:
        raise PermissionError(13, "Permission denied", full)

    monkeypatch.setattr(local, "atomic_write", deny)
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
    # A store never holds them: tests/unit/storage/test_url_credentials_redact.py.
