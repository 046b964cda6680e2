"""Restore from S3 (moto's real server on 127.0.0.1, faults as real HTTP answers):
a throttled or denied payload read fails the restore instead of falling back
(issue 9, case 4); an unloadable payload stops the run (case 1); restore streams the
payload into ``torch.load`` so its peak memory stays near one copy of the state
(case 8)."""
from __future__ import annotations

import pathlib
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from elastictrain.core.errors import (
    SnapshotCorrupt,
    SnapshotUnloadable,
    StorageError,
    StoragePermissionError,
    StorageTransientError,
)
from elastictrain.snapshot.durable.restore import load_newest, resolve_mode
from elastictrain.snapshot.format.reader import list_snapshot_dirs, read_manifest, verify_snapshot
from elastictrain.storage import FsspecStore
from elastictrain.worker.dist import DistContext
from tests.planted import plant_snapshot
from tests.s3server import Request, S3Bucket

pytestmark = pytest.mark.s3
SINGLE = DistContext(0, 1, 0, "gloo", torch.device("cpu"), False)
# botocore's own per-request retries off, so the counts below are elastictrain's and s3fs's.
ONE_ATTEMPT = {"config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 1}}}
def s3_store(bucket: S3Bucket, **options: Any) -> FsspecStore:
    return FsspecStore(bucket.url(), {**bucket.options, **options}, retries=2,
                       retry_backoff_s=0.01)


def save(store: FsspecStore, step: int) -> None:
    plant_snapshot(store, step, {"step": step, "w": torch.full((64,), float(step))})


def payload_get(store: FsspecStore, step: int) -> Any:
    name = read_manifest(store, step).objects[0].name

    def match(r: Request) -> bool:
        return r.op == "GetObject" and r.path.endswith(f"step_{step:012d}/{name}")

    return match


def test_restore_mode_auto_is_broadcast_on_object_stores(s3: S3Bucket, tmp_path: Path) -> None:
    assert resolve_mode(s3_store(s3), "auto") == "broadcast"
    assert resolve_mode(FsspecStore(str(tmp_path)), "auto") == "each"
    assert resolve_mode(s3_store(s3), "each") == "each"


@pytest.mark.parametrize(("status", "code", "raised"), [
    (503, "SlowDown", StorageTransientError),
    (403, "AccessDenied", StoragePermissionError),
])
def test_a_failing_payload_read_on_s3_fails_the_restore(
        s3: S3Bucket, status: int, code: str, raised: type[StorageError]) -> None:
    store = s3_store(s3, **ONE_ATTEMPT)
    save(store, 10)
    save(store, 20)
    s3.server.faults.error(payload_get(store, 20), status, code, times=1000)
    with capture_logs() as logs, pytest.raises(raised) as info:
        load_newest(store, SINGLE)
    assert "step_000000000020" in str(info.value)
    assert "snapshot.corrupt" not in [e["event"] for e in logs]
    s3.server.faults.clear()
    assert list_snapshot_dirs(store) == [20, 10]
    loaded = load_newest(store, SINGLE)  # the fault is gone: the newest loads
    assert loaded is not None and loaded.step == 20


def test_a_throttled_payload_read_that_clears_restores_the_newest(s3: S3Bucket) -> None:
    store = s3_store(s3, **ONE_ATTEMPT)
    save(store, 10)
    save(store, 20)
    s3.server.faults.throttle(payload_get(store, 20), times=2)
    loaded = load_newest(store, SINGLE)
    assert loaded is not None and loaded.step == 20
    assert torch.equal(loaded.payload["w"], torch.full((64,), 20.0))


def test_restore_reads_manifest_and_payload_only(s3: S3Bucket) -> None:
    """The payload's size comes from the GET's own answer (Content-Range): no HEAD."""
    store = s3_store(s3)
    save(store, 10)
    before = len(s3.server.faults.seen())
    loaded = load_newest(store, SINGLE)
    assert loaded is not None and loaded.step == 10
    ops = [r.op for r in s3.server.faults.seen()[before:]]
    assert "HeadObject" not in ops
    assert ops.count("GetObject") == 2, ops  # the manifest, the payload in one GET


@pytest.mark.parametrize("change", [-1, 5])
def test_a_payload_of_the_wrong_size_is_corrupt_and_skipped(s3: S3Bucket,
                                                            change: int) -> None:
    """A payload shorter or longer than its manifest says is corrupt (the GET's answer
    says so): restore skips it, verify names the sizes."""
    store = s3_store(s3)
    save(store, 10)
    save(store, 20)
    name = read_manifest(store, 20).objects[0].name
    path = f"snapshots/step_{20:012d}/{name}"
    data = store.read_bytes(path)
    store.write_bytes(path, data[:change] if change < 0 else data + bytes(change))
    with pytest.raises(SnapshotCorrupt, match=rf"{len(data) + change} bytes, manifest says "
                                              rf"{len(data)} \(truncated\?\)"):
        verify_snapshot(store, 20)
    loaded = load_newest(store, SINGLE)
    assert loaded is not None and loaded.step == 10
    assert store.exists(path)  # nothing is deleted by a restore


def test_an_unloadable_payload_on_s3_stops_the_run(s3: S3Bucket) -> None:
    store = s3_store(s3)
    save(store, 10)
    plant_snapshot(store, 20, {"extras": {"data_dir": pathlib.Path("/data")}})
    with capture_logs() as logs, pytest.raises(SnapshotUnloadable, match=r"pathlib\.PosixPath"):
        load_newest(store, SINGLE)
    assert "snapshot.corrupt" not in [e["event"] for e in logs]


