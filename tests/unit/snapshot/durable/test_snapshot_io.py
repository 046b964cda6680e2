"""Commit protocol, discovery with fallback, verification and retention."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from elastictrain.core import layout
from elastictrain.core.errors import SnapshotCorrupt
from elastictrain.snapshot.durable.commit import persist_snapshot
from elastictrain.snapshot.durable.retention import prune
from elastictrain.snapshot.format.manifest import SnapshotMeta
from elastictrain.snapshot.format.reader import (
    find_latest_verified,
    list_snapshot_dirs,
    read_manifest,
    verify_snapshot,
)
from elastictrain.snapshot.state.staging import StagingBuffers
from elastictrain.storage import open_store


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    if request.param == "local":
        yield open_store(str(tmp_path / "run"))
        return
    s = open_store(f"memory://snap-{os.getpid()}-{id(request)}")
    yield s
    s.delete("", recursive=True)


def save(store, step: int, value: float = 0.0) -> None:  # type: ignore[no-untyped-def]
    payload = {"step": step, "w": torch.full((64,), value + step), "rng": [torch.arange(3)]}
    meta = SnapshotMeta(run_id="t", step=step, epoch=0, world_size=1, checksum_algorithm="crc32")
    persist_snapshot(store, payload, meta)


def test_persist_commits_manifest_and_loadable_payload(store) -> None:  # type: ignore[no-untyped-def]
    save(store, 12)
    assert store.list_dir(layout.SNAPSHOTS) == ["step_000000000012"]
    found = verify_snapshot(store, 12, load=True)
    assert found.manifest.step == 12 and layout.is_payload(found.manifest.objects[0].name)
    assert found.payload is not None
    assert torch.equal(found.payload["w"], torch.full((64,), 12.0))


@pytest.mark.parametrize("damage", ["truncate", "flip", "drop_manifest", "drop_payload",
                                    "bad_manifest"])
def test_damaged_newest_falls_back_to_previous(store, damage: str) -> None:  # type: ignore[no-untyped-def]
    save(store, 10)
    save(store, 20)
    newest = layout.step_dir(20)
    # Object stores name the payload per writer (state-<token>.pt): ask the manifest.
    payload_path = f"{newest}/{read_manifest(store, 20).objects[0].name}"
    data = store.read_bytes(payload_path)
    if damage == "truncate":
        store.write_bytes(payload_path, data[: len(data) // 2])
    elif damage == "flip":
        store.write_bytes(payload_path, data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "drop_manifest":
        store.delete(f"{newest}/{layout.MANIFEST}")
    elif damage == "drop_payload":
        store.delete(payload_path)
    else:
        store.write_bytes(f"{newest}/{layout.MANIFEST}", b'{"step": "twenty"}')
    with capture_logs() as logs:
        found = find_latest_verified(store)
    assert found is not None and found.step == 10
    corrupt = [e for e in logs if e["event"] == "snapshot.corrupt"]
    assert [e["snapshot_step"] for e in corrupt] == [20]
    assert store.exists(newest)  # skipped, never deleted by discovery
    with pytest.raises(SnapshotCorrupt):
        verify_snapshot(store, 20)


def test_only_snapshot_corrupt_is_not_loaded_nor_deleted(store) -> None:  # type: ignore[no-untyped-def]
    save(store, 5)
    store.delete(f"{layout.step_dir(5)}/{layout.MANIFEST}")
    assert find_latest_verified(store) is None
    assert list_snapshot_dirs(store) == [5]


def test_resave_of_a_corrupt_step_replaces_it(store) -> None:  # type: ignore[no-untyped-def]
    save(store, 7, value=1.0)
    store.write_bytes(f"{layout.step_dir(7)}/{read_manifest(store, 7).objects[0].name}",
                      b"garbage")
    save(store, 7, value=2.0)
    payload = verify_snapshot(store, 7, load=True).payload
    assert payload is not None and torch.equal(payload["w"], torch.full((64,), 9.0))


def test_retention_keeps_newest_and_clears_partials(store) -> None:  # type: ignore[no-untyped-def]
    for step in (1, 2, 3, 4):
        save(store, step)
    store.write_bytes(f"{layout.step_dir(0)}/{layout.PAYLOAD}", b"abandoned upload")
    store.write_bytes(f"{layout.SNAPSHOTS}/.partial-step_000000000009-abc/state.pt", b"x")
    with capture_logs() as logs:
        pruned = prune(store, keep=2, newest_step=4)
    assert sorted(pruned) == [1, 2]
    assert store.list_dir(layout.SNAPSHOTS) == ["step_000000000003", "step_000000000004"]
    reasons = sorted(e["reason"] for e in logs if e["event"] == "snapshot.pruned")
    assert reasons == ["partial", "partial", "retention", "retention"]


def test_local_commit_is_a_rename_of_a_complete_directory(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    calls: list[tuple[str, str]] = []
    original = store.rename

    def spy(src: str, dst: str) -> None:
        # At rename time the staging dir already holds payload and manifest.
        names = sorted(os.listdir(tmp_path / src))
        calls.append((src, ",".join(names)))
        original(src, dst)

    store.rename = spy  # type: ignore[method-assign]
    save(store, 3)
    ((src, names),) = calls
    assert src.startswith("snapshots/.partial-step_000000000003-")
    assert names == "MANIFEST.json,state.pt"


def test_staging_reuses_buffers_and_decouples_from_live_state() -> None:
    staging = StagingBuffers()
    live = {"w": torch.zeros(1000), "opt": [{"m": torch.ones(10)}], "n": 3}
    first = staging.stage(live)
    live["w"].add_(5)
    assert float(first["w"].sum()) == 0.0  # a copy, not a view of live state
    second = staging.stage(live)
    assert staging.allocations == 2  # one slab per top-level key and dtype, allocated once
    assert second["w"].data_ptr() == first["w"].data_ptr()
    assert float(second["w"].sum()) == 5000.0 and second["n"] == 3
    assert staging.nbytes == 4032 + 64  # each buffer padded to 64 bytes
