"""Store.read_into: the object's bytes straight into a caller's buffer; on S3 as
parallel ranged GETs on a real (moto) server."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from elastictrain.core.errors import ObjectSizeMismatch, StorageError
from elastictrain.storage import FsspecStore, open_store
from tests.helpers import wait_for
from tests.s3server import S3Bucket
from tests.unit.storage.test_s3_multipart import MIB, data_of, s3_store


def _gets(bucket: S3Bucket, key: str) -> int:
    return len(bucket.server.faults.seen(lambda r: r.op == "GetObject" and r.path.endswith(key)))


@pytest.mark.s3
def test_s3_read_into_fills_the_buffer_in_concurrency_ranges(s3: S3Bucket) -> None:
    store = s3_store(s3)  # parts of 5 MiB, 2 at a time, one GET up to 5 MiB
    data = data_of(12 * MIB + 3)
    store.write_bytes("big.bin", data)
    buffer = bytearray(len(data))
    assert store.read_into("big.bin", buffer) == len(data)
    assert buffer == data
    # Two ranges of 6 MiB (concurrency of them, at least a part each), streamed into
    # the buffer: ranged, not one whole GET, and no HEAD.
    assert _gets(s3, "big.bin") == 2
    assert not s3.server.faults.seen(lambda r: r.op == "HeadObject")


@pytest.mark.s3
def test_s3_an_object_up_to_the_threshold_is_one_get(s3: S3Bucket) -> None:
    store = s3_store(s3, multipart_threshold_bytes=16 * MIB)
    data = data_of(12 * MIB)
    store.write_bytes("mid.bin", data)
    buffer = bytearray(len(data))
    store.read_into("mid.bin", buffer, object_size=len(data))
    assert buffer == data and _gets(s3, "mid.bin") == 1


@pytest.mark.s3
@pytest.mark.parametrize("actual", [11 * MIB, 12 * MIB + 7, 3 * MIB])
def test_s3_object_size_is_checked_from_the_answers(s3: S3Bucket, actual: int) -> None:
    """A longer object, a shorter one, one shorter than the later ranges start (those
    get a 416): each is an ObjectSizeMismatch naming its real size."""
    store = s3_store(s3)
    store.write_bytes("obj.bin", data_of(actual))
    with pytest.raises(ObjectSizeMismatch, match=rf"is {actual} bytes, {12 * MIB} expected") \
            as caught:
        store.read_into("obj.bin", bytearray(12 * MIB), object_size=12 * MIB)
    assert caught.value.actual == actual


@pytest.mark.s3
def test_s3_read_into_at_an_offset_into_a_tensor(s3: S3Bucket) -> None:
    store = s3_store(s3)
    data = data_of(11 * MIB)
    store.write_bytes("big.bin", data)
    tensor = torch.empty(6 * MIB, dtype=torch.uint8)
    store.read_into("big.bin", tensor.numpy(), offset=4 * MIB + 1)
    assert tensor.numpy().tobytes() == data[4 * MIB + 1:10 * MIB + 1]


@pytest.mark.s3
def test_s3_ranges_are_fetched_concurrently(s3: S3Bucket) -> None:
    store = s3_store(s3, upload_concurrency=2)
    data = data_of(15 * MIB)
    store.write_bytes("big.bin", data)
    first = s3.server.faults.hold(lambda r: r.op == "GetObject" and r.path.endswith("big.bin"),
                                  forward=True)
    buffer = bytearray(len(data))
    failure: list[BaseException] = []

    def read() -> None:
        try:
            store.read_into("big.bin", buffer)
        except BaseException as exc:
            failure.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert first.arrived.wait(timeout=60)
        # While one range is parked on the server, the other reader asks for the next.
        wait_for(lambda: _gets(s3, "big.bin") >= 2, timeout=60, what="a second ranged GET")
    finally:
        first.release()
        reader.join(timeout=120)
    assert not reader.is_alive() and not failure
    assert buffer == data


@pytest.mark.s3
def test_s3_short_object_is_a_clear_error(s3: S3Bucket) -> None:
    store = s3_store(s3)
    store.write_bytes("small.bin", data_of(6 * MIB))
    with pytest.raises(StorageError, match=r"small\.bin: the object ends after 6291456 bytes, "
                                           r"6291466 expected; fix:"):
        store.read_into("small.bin", bytearray(6 * MIB + 10))


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_read_into_on_other_stores(tmp_path: Path, kind: str) -> None:
    url = str(tmp_path / "store") if kind == "local" else f"memory://read-into-{tmp_path.name}"
    store: FsspecStore = open_store(url)
    data = data_of(3 * MIB + 5)
    store.write_bytes("obj.bin", data)
    whole = np.empty(len(data), dtype=np.uint8)
    assert store.read_into("obj.bin", whole) == len(data)
    assert whole.tobytes() == data
    part = bytearray(1000)
    store.read_into("obj.bin", part, offset=MIB)
    assert part == data[MIB:MIB + 1000]
    with pytest.raises(StorageError, match="ends after"):
        store.read_into("obj.bin", bytearray(10), offset=len(data) - 5)
    with pytest.raises(ValueError, match="read-only"):
        store.read_into("obj.bin", b"\0" * 10)
    if kind == "memory":
        store.delete("", recursive=True)


@pytest.mark.s3
@pytest.mark.parametrize("size", [0, 1000])
def test_s3_read_bytes_is_one_get(s3: S3Bucket, size: int) -> None:
    """No HEAD before the GET (s3fs's whole-object read asks for the size first); an
    empty object, whose ranges S3 refuses, still reads."""
    store = s3_store(s3)
    store.write_bytes("m.json", data_of(size))
    before = len(s3.server.faults.seen())
    assert store.read_bytes("m.json") == data_of(size)
    ops = [r.op for r in s3.server.faults.seen()[before:]]
    assert ops == ["GetObject"] if size else ops[0] == "GetObject", ops
