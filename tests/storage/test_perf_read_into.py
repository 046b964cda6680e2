"""Store.read_into: the object's bytes straight into a caller's buffer; on S3 as
parallel ranged GETs on a real (moto) server."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from elastictrain.errors import StorageError
from elastictrain.storage import FsspecStore, open_store
from tests.helpers import wait_for
from tests.s3server import S3Bucket
from tests.storage.test_s3_multipart import MIB, data_of, s3_store


def _gets(bucket: S3Bucket, key: str) -> int:
    return len(bucket.server.faults.seen(lambda r: r.op == "GetObject" and r.path.endswith(key)))


@pytest.mark.s3
def test_s3_read_into_fills_the_buffer_in_part_sized_ranges(s3: S3Bucket) -> None:
    store = s3_store(s3)  # parts of 5 MiB, 2 at a time
    data = data_of(12 * MIB + 3)
    store.write_bytes("big.bin", data)
    buffer = bytearray(len(data))
    assert store.read_into("big.bin", buffer) == len(data)
    assert buffer == data
    assert _gets(s3, "big.bin") == 3  # 5 + 5 + 2 MiB: ranged, not one whole GET


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
