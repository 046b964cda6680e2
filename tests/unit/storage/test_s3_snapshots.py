"""The snapshot commit protocol on a real S3 server: no rename, manifest last and
create-only, racing writers, lost responses, partial uploads, fresh discovery."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from elastictrain.core import layout
from elastictrain.snapshot.durable.commit import persist_snapshot
from elastictrain.snapshot.durable.retention import prune
from elastictrain.snapshot.format.manifest import Manifest, SnapshotMeta
from elastictrain.snapshot.format.reader import find_latest_verified, read_manifest
from elastictrain.storage import FsspecStore
from tests.helpers import wait_for
from tests.s3server import S3Bucket

pytestmark = pytest.mark.s3


def s3_store(bucket: S3Bucket, **options: Any) -> FsspecStore:
    return FsspecStore(bucket.url(), {**bucket.options, **options}, retries=2,
                       retry_backoff_s=0.05)


def save(store: FsspecStore, step: int, value: float = 0.0) -> Manifest | None:
    payload = {"step": step, "w": torch.full((256,), value + step)}
    meta = SnapshotMeta(run_id="t", step=step, epoch=0, world_size=1, checksum_algorithm="crc32")
    return persist_snapshot(store, payload, meta)


def is_manifest_put(r: Any) -> bool:
    return bool(r.op == "PutObject" and r.path.endswith("/" + layout.MANIFEST))


def test_payload_first_then_one_create_only_manifest_put(s3: S3Bucket) -> None:
    store = s3_store(s3)
    manifest = save(store, 10)
    assert manifest is not None
    writes = [r for r in s3.server.faults.seen(lambda r: r.method in ("PUT", "POST"))
              if "/snapshots/" in r.path]
    assert [r.path.rsplit("/", 1)[1] for r in writes] == [manifest.objects[0].name,
                                                          layout.MANIFEST]
    assert writes[-1].if_none_match == "*"
    assert not s3.server.faults.seen(lambda r: "x-amz-copy-source" in r.path)  # no rename
    assert sorted(s3.keys("run/snapshots/")) == sorted(
        f"run/snapshots/step_000000000010/{n}" for n in (layout.MANIFEST,
                                                         manifest.objects[0].name))


def test_a_persist_is_three_requests(s3: S3Bucket) -> None:
    """The committed-already check is one GET of the manifest (a 404), then the payload
    PUT and the create-only manifest PUT: no HEAD, no listing."""
    store = s3_store(s3)
    before = len(s3.server.faults.seen())
    assert save(store, 10) is not None
    ops = [(r.op, r.status) for r in s3.server.faults.seen()[before:]]
    assert ops == [("GetObject", 404), ("PutObject", 200), ("PutObject", 200)], ops
    assert save(store, 10) is None  # already committed, verified: kept


def test_two_writers_racing_for_one_step_commit_exactly_one(s3: S3Bucket) -> None:
    """Both upload their own payload; both manifest PUTs are held and released together;
    exactly one wins, the other backs off and deletes its payload."""
    held = s3.server.faults.hold(is_manifest_put, times=2, forward=True)
    stores = [s3_store(s3, skip_instance_cache=True) for _ in range(2)]
    results: dict[int, Manifest | BaseException | None] = {}

    def write(i: int) -> None:
        try:
            results[i] = save(stores[i], 40, value=100.0 * (i + 1))
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert held.arrived.wait(60)
    wait_for(lambda: len(s3.server.faults.seen(is_manifest_put)) == 2, 60,
             "both manifest PUTs at the server")
    held.release()
    for t in threads:
        t.join(60)
    winners = [i for i, r in results.items() if isinstance(r, Manifest)]
    assert len(winners) == 1 and results[1 - winners[0]] is None, results
    statuses = sorted(r.status or 0 for r in s3.server.faults.seen(is_manifest_put))
    assert statuses == [200, 412]
    winner = results[winners[0]]
    assert isinstance(winner, Manifest)
    assert store_names(s3, 40) == sorted([layout.MANIFEST, winner.objects[0].name])
    found = find_latest_verified(s3_store(s3))
    assert found is not None and found.manifest == winner and found.payload is not None
    assert torch.equal(found.payload["w"],
                       torch.full((256,), 100.0 * (winners[0] + 1) + 40))


def store_names(bucket: S3Bucket, step: int) -> list[str]:
    prefix = f"run/{layout.step_dir(step)}/"
    return sorted(k[len(prefix):] for k in bucket.keys(prefix))


def test_lost_response_to_our_own_manifest_put_is_not_a_conflict(s3: S3Bucket) -> None:
    """The manifest PUT succeeds but its answer is lost; the retry gets 412 because the
    manifest is ours: the save commits, not fails."""
    s3.server.faults.drop(is_manifest_put, times=1, after=True)
    store = s3_store(s3)
    manifest = save(store, 50)
    assert manifest is not None
    assert [r.status for r in s3.server.faults.seen(is_manifest_put)] == [None, 412]
    assert read_manifest(store, 50) == manifest


def test_partial_upload_is_never_loaded_and_retention_clears_it(s3: S3Bucket) -> None:
    store = s3_store(s3)
    save(store, 10)
    save(store, 20)
    # An attempt that died after its payload, before its manifest; and an orphan payload
    # left in a committed snapshot by a writer that lost its race and then died.
    store.write_bytes(f"{layout.step_dir(30)}/{layout.payload_name('deadbeef')}", b"partial")
    store.write_bytes(f"{layout.step_dir(20)}/{layout.payload_name('0badf00d')}", b"orphan")
    with capture_logs() as logs:
        found = find_latest_verified(store)
    assert found is not None and found.step == 20
    assert [e["snapshot_step"] for e in logs if e["event"] == "snapshot.corrupt"] == [30]
    save(store, 40)
    with capture_logs() as logs:
        prune(store, keep=2, newest_step=40)
    reasons = sorted((e["reason"], e["snapshot_step"]) for e in logs
                     if e["event"] == "snapshot.pruned")
    assert reasons == [("orphan", 20), ("partial", 30), ("retention", 10)]
    assert store.list_dir(layout.SNAPSHOTS) == ["step_000000000020", "step_000000000040"]
    assert layout.payload_name("0badf00d") not in store_names(s3, 20)
    assert len(store_names(s3, 20)) == 2


def test_manifest_naming_a_missing_object_falls_back(s3: S3Bucket) -> None:
    store = s3_store(s3)
    save(store, 10)
    newest = save(store, 20)
    assert newest is not None
    s3.server.client().delete_object(
        Bucket=s3.name, Key=f"run/{layout.step_dir(20)}/{newest.objects[0].name}")
    with capture_logs() as logs:
        found = find_latest_verified(store)
    assert found is not None and found.step == 10
    corrupt = [e for e in logs if e["event"] == "snapshot.corrupt"]
    assert len(corrupt) == 1 and corrupt[0]["snapshot_step"] == 20
    assert "missing" in corrupt[0]["reason"] and s3.url() in corrupt[0]["reason"]


def test_discovery_sees_a_step_committed_by_another_client(s3: S3Bucket) -> None:
    reader = s3_store(s3)
    writer = s3_store(s3, skip_instance_cache=True)
    save(writer, 10)
    first = find_latest_verified(reader)
    assert first is not None and first.step == 10
    reader.fs.ls(f"{reader.root}/{layout.SNAPSHOTS}", detail=False)  # s3fs caches it
    save(writer, 20)
    # reader's s3fs still holds the listing from before step 20 ...
    cached = reader.fs.ls(f"{reader.root}/{layout.SNAPSHOTS}", detail=False)
    assert [p.rsplit("/", 1)[1] for p in cached] == ["step_000000000010"]
    # ... and discovery does not use it.
    found = find_latest_verified(reader)
    assert found is not None and found.step == 20
