"""Streaming multipart uploads on a real S3 server: parts, bounded memory, aborts,
and a server that goes away in the middle of an upload."""
from __future__ import annotations

import base64
import threading
import zlib

import pytest
import torch
from structlog.testing import capture_logs

from elastictrain.core.errors import StorageError
from elastictrain.snapshot.durable.commit import persist_snapshot
from elastictrain.snapshot.format.manifest import SnapshotMeta
from elastictrain.snapshot.format.reader import verify_snapshot
from elastictrain.storage import FsspecStore
from tests.s3server import S3Bucket

pytestmark = pytest.mark.s3
MIB = 2**20
def s3_store(bucket: S3Bucket, **kwargs: object) -> FsspecStore:
    settings = {"retries": 1, "retry_backoff_s": 0.05, "part_size_bytes": 5 * MIB,
                "multipart_threshold_bytes": 5 * MIB, "upload_concurrency": 2, **kwargs}
    options = {**bucket.options,
               "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 1}}}
    return FsspecStore(bucket.url(), options, **settings)  # type: ignore[arg-type]


def data_of(size: int) -> bytes:
    return (bytes(range(251)) * (size // 251 + 1))[:size]


def ops(bucket: S3Bucket) -> list[str]:
    return [r.op for r in bucket.server.faults.seen(lambda r: "/run/" in r.path)]


def test_large_stream_is_one_multipart_upload(s3: S3Bucket) -> None:
    store = s3_store(s3)
    data = data_of(11 * MIB)
    with store.open_write("big.bin") as f:
        for start in range(0, len(data), 64 * 1024):  # torch.save writes in pieces too
            f.write(data[start:start + 64 * 1024])
    assert ops(s3) == ["CreateMultipartUpload", "UploadPart", "UploadPart", "UploadPart",
                       "CompleteMultipartUpload"]
    assert s3.server.client().head_object(Bucket=s3.name, Key="run/big.bin")["ETag"].endswith(
        '-3"')
    assert store.read_bytes("big.bin") == data


def test_multipart_object_carries_the_composite_crc32_of_its_parts(s3: S3Bucket) -> None:
    """The upload names CRC32 at its start and each part's checksum at its end, so the
    store keeps a composite checksum of the parts it checked (no whole-object pass)."""
    store = s3_store(s3)
    data = data_of(11 * MIB)
    with store.open_write("big.bin") as f:
        f.write(data)
    head = s3.server.client().head_object(Bucket=s3.name, Key="run/big.bin",
                                          ChecksumMode="ENABLED")
    parts = [zlib.crc32(data[i:i + 5 * MIB]).to_bytes(4, "big") for i in range(0, len(data),
                                                                              5 * MIB)]
    composite = base64.b64encode(zlib.crc32(b"".join(parts)).to_bytes(4, "big")).decode()
    # S3 answers "<checksum>-3" with ChecksumType COMPOSITE; moto the checksum alone.
    assert head["ChecksumCRC32"] in (composite, f"{composite}-3")
    assert head.get("ChecksumType", "COMPOSITE") == "COMPOSITE"


def test_stream_within_one_part_is_one_put(s3: S3Bucket) -> None:
    store = s3_store(s3)
    with store.open_write("small.bin") as f:
        f.write(data_of(3 * MIB))
    assert ops(s3) == ["PutObject"]
    assert store.size("small.bin") == 3 * MIB


def test_threshold_sets_the_single_put_limit_and_the_first_part(s3: S3Bucket) -> None:
    """Up to the threshold: one PUT. Beyond: the first part is the threshold's size,
    then part_size parts (12 MiB with an 8 MiB threshold: 2 parts, not 3)."""
    store = s3_store(s3, multipart_threshold_bytes=8 * MIB)
    with store.open_write("eight.bin") as f:
        f.write(data_of(8 * MIB))
    with store.open_write("twelve.bin") as f:
        f.write(data_of(12 * MIB))
    assert ops(s3) == ["PutObject", "CreateMultipartUpload", "UploadPart", "UploadPart",
                       "CompleteMultipartUpload"]
    head = s3.server.client().head_object(Bucket=s3.name, Key="run/twelve.bin")
    assert head["ETag"].endswith('-2"') and head["ContentLength"] == 12 * MIB
    assert store.read_bytes("twelve.bin") == data_of(12 * MIB)


def test_failed_part_aborts_the_upload(s3: S3Bucket) -> None:
    s3.server.faults.error(lambda r: r.op == "UploadPart" and r.part == 2, 400,
                           "InvalidArgument", "injected: part rejected")
    store = s3_store(s3)
    with capture_logs() as logs, pytest.raises(StorageError, match="part rejected"), \
            store.open_write("big.bin") as f:
        f.write(data_of(16 * MIB))
    assert "AbortMultipartUpload" in ops(s3) and "CompleteMultipartUpload" not in ops(s3)
    assert s3.keys() == [] and s3.server.pending_uploads(s3.name) == []
    assert [e["event"] for e in logs if e["event"].startswith("storage.upload")] == [
        "storage.upload_aborted"]


def test_exception_in_the_writer_aborts_the_upload(s3: S3Bucket) -> None:
    store = s3_store(s3)
    with pytest.raises(KeyError), store.open_write("big.bin") as f:
        f.write(data_of(12 * MIB))
        raise KeyError("torch.save failed")
    assert "AbortMultipartUpload" in ops(s3)
    assert s3.keys() == [] and s3.server.pending_uploads(s3.name) == []


def test_server_stopping_mid_upload_leaves_no_object(s3: S3Bucket) -> None:
    """The server dies while part 2 is in flight: the upload fails, no object appears
    (the upload cannot even be aborted: its parts stay invisible until a lifecycle
    rule reclaims them), and once the server is back a new upload succeeds."""
    server = s3.server
    held = server.faults.hold(lambda r: r.op == "UploadPart" and r.part == 2)
    store = s3_store(s3)
    failure: list[BaseException] = []

    def upload() -> None:
        try:
            with store.open_write("big.bin") as f:
                f.write(data_of(12 * MIB))
        except BaseException as exc:
            failure.append(exc)

    with capture_logs() as logs:
        writer = threading.Thread(target=upload)
        writer.start()
        assert held.arrived.wait(60), "part 2 never reached the server"
        server.stop()
        writer.join(120)
        assert not writer.is_alive()
    server.start()  # same port, same state
    assert len(failure) == 1 and isinstance(failure[0], StorageError)
    assert "big.bin" in str(failure[0])
    assert s3.keys() == []
    assert server.pending_uploads(s3.name) == ["run/big.bin"]
    names = [e["event"] for e in logs]
    assert "storage.retry" in names and "storage.upload_abort_failed" in names
    with store.open_write("big.bin") as f:
        f.write(data_of(12 * MIB))
    assert store.read_bytes("big.bin") == data_of(12 * MIB)


def test_multipart_snapshot_round_trips_and_verifies(s3: S3Bucket) -> None:
    """A snapshot streamed as a multipart upload (views of the state, a CRC32 sent with
    each part) commits, verifies against its manifest and loads back."""
    store = s3_store(s3)
    state = {"model": {f"w{i}": torch.randn(MIB) for i in range(3)}, "step": torch.tensor(7)}
    meta = SnapshotMeta(run_id="r", step=1, epoch=0, world_size=1, checksum_algorithm="crc32")
    manifest = persist_snapshot(store, state, meta)
    assert manifest is not None and manifest.total_bytes > 12 * MIB
    assert ops(s3).count("UploadPart") == 3
    found = verify_snapshot(store, 1, load=True)
    assert found.manifest == manifest and found.payload is not None
    for name, tensor in state["model"].items():
        assert torch.equal(found.payload["model"][name], tensor)


