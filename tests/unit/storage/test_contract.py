"""The storage contract: every test here runs unchanged on local disk, memory:// and
s3:// (moto's real server). A backend is usable for snapshots only if it passes all.

Backend-specific behaviour (local rename and fsync, S3 errors, retries and multipart
details) is tested beside this file, in test_local.py and test_s3*.py.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastictrain.core.errors import StorageConflictError, StorageNotFoundError
from elastictrain.storage import FsspecStore
from tests.s3server import FAKE_KEY, FAKE_SECRET

MIB = 2**20
BACKENDS = ["local", "memory", pytest.param("s3", marks=pytest.mark.s3)]


def _open(kind: str, tmp_path: Path, request: pytest.FixtureRequest,
          token: str) -> tuple[FsspecStore, Any]:
    """A store of ``kind`` and what a second, independent client needs to open it."""
    if kind == "local":
        return FsspecStore(str(tmp_path / "root")), (str(tmp_path / "root"), {})
    if kind == "memory":
        url = f"memory://contract-{os.getpid()}-{token}"
        return FsspecStore(url), (url, {})
    bucket = request.getfixturevalue("s3")
    # Small parts so that modest payloads exercise real multipart uploads.
    store = FsspecStore(bucket.url(token), bucket.options, retries=2, retry_backoff_s=0.05,
                        part_size_bytes=5 * MIB, multipart_threshold_bytes=5 * MIB,
                        upload_concurrency=2)
    return store, (bucket.url(token), {**bucket.options, "skip_instance_cache": True})


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[FsspecStore, Any]]:
    store, other = _open(request.param, tmp_path, request, uuid.uuid4().hex[:8])
    yield store, other
    if request.param == "memory":
        store.delete("", recursive=True)


@pytest.fixture
def store(backend: tuple[FsspecStore, Any]) -> FsspecStore:
    return backend[0]


@pytest.fixture
def other_client(backend: tuple[FsspecStore, Any]) -> FsspecStore:
    """The same location through a separate client (its own caches), like another process."""
    url, options = backend[1]
    return FsspecStore(url, options)


def pattern(size: int) -> bytes:
    """Position-dependent bytes: a dropped, repeated or reordered part shows."""
    block = bytes(i % 251 for i in range(251))
    return (block * (size // 251 + 1))[:size]


def test_write_read_list_delete(store: FsspecStore) -> None:
    store.write_bytes("a/b.bin", b"hello")
    with store.open_write("a/c.bin") as f:
        f.write(b"x" * 10)
    assert store.read_bytes("a/b.bin") == b"hello"
    assert store.list_dir("a") == ["b.bin", "c.bin"]
    assert store.size("a/c.bin") == 10 and store.exists("a/c.bin")
    store.delete("a", recursive=True)
    assert store.list_dir("a") == [] and not store.exists("a/b.bin")


def test_list_dir_names_one_level(store: FsspecStore) -> None:
    store.write_bytes("snapshots/step_1/MANIFEST.json", b"{}")
    store.write_bytes("snapshots/step_2/state.pt", b"x")
    store.write_bytes("snapshots/top.txt", b"x")
    assert store.list_dir("snapshots") == ["step_1", "step_2", "top.txt"]
    assert store.list_dir("nothing/here") == []


@pytest.mark.parametrize("size", [0, 1000, 11 * MIB + 3])
def test_streamed_write_round_trips(store: FsspecStore, size: int) -> None:
    """Writes of any size and chunking read back byte-identical (11 MiB: 3 S3 parts)."""
    data = pattern(size)
    with store.open_write("obj.bin") as f:
        for start in range(0, size, MIB + 7):  # chunks that straddle part boundaries
            f.write(memoryview(data)[start:start + MIB + 7])
    assert store.size("obj.bin") == size
    assert store.read_bytes("obj.bin") == data
    with store.open_read("obj.bin") as f:
        assert f.read(1000) == data[:1000]


def test_failed_streamed_write_leaves_nothing(store: FsspecStore) -> None:
    """An exception inside open_write (torch.save failing mid-way) leaves no object."""
    with pytest.raises(RuntimeError, match="serialisation failed"), \
            store.open_write("dir/obj.bin") as f:
        f.write(pattern(6 * MIB))  # past the first S3 part: a multipart upload is open
        raise RuntimeError("serialisation failed")
    assert not store.exists("dir/obj.bin")
    assert store.list_dir("dir") == []


def test_if_absent_refuses_to_clobber(store: FsspecStore) -> None:
    store.write_bytes("m.json", b"first", if_absent=True)
    with pytest.raises(StorageConflictError, match="already exists"):
        store.write_bytes("m.json", b"second", if_absent=True)
    assert store.read_bytes("m.json") == b"first"
    store.write_bytes("m.json", b"third")  # a plain write still replaces
    assert store.read_bytes("m.json") == b"third"


def test_missing_object_is_storage_not_found(store: FsspecStore) -> None:
    with pytest.raises(StorageNotFoundError, match="not found; fix") as info:
        store.read_bytes("nope.bin")
    assert store.url.rstrip("/") + "/nope.bin" in str(info.value)
    assert not store.exists("nope.bin")


def test_listing_sees_another_clients_writes(store: FsspecStore,
                                             other_client: FsspecStore) -> None:
    """Listings and existence checks are fresh: what another client wrote or deleted
    after our last look shows at once (s3fs would otherwise serve a cached listing)."""
    store.write_bytes("snapshots/step_1/MANIFEST.json", b"{}")
    assert store.list_dir("snapshots") == ["step_1"]
    assert store.exists("snapshots/step_1/MANIFEST.json")
    other_client.write_bytes("snapshots/step_2/MANIFEST.json", b"{}")
    other_client.delete("snapshots/step_1", recursive=True)
    assert store.list_dir("snapshots") == ["step_2"]
    assert store.exists("snapshots/step_2/MANIFEST.json")
    assert not store.exists("snapshots/step_1/MANIFEST.json")


def test_delete_of_missing_path_is_a_no_op(store: FsspecStore) -> None:
    store.delete("never/written.bin")
    store.delete("never", recursive=True)
    assert store.list_dir("never") == []


def test_check_writable_leaves_nothing_behind(store: FsspecStore) -> None:
    store.check_writable()
    assert store.list_dir("") == []


def test_url_and_repr_carry_no_credentials(store: FsspecStore) -> None:
    for text in (store.url, repr(store)):
        assert FAKE_KEY not in text and FAKE_SECRET not in text
