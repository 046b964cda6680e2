"""Sharded snapshots in one process (DCP without a process group) on a local
directory and memory://: exact resume, a missing or corrupt part falls back,
read errors do not, and the operator commands see the parts."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import pytest
import torch
from structlog.testing import capture_logs

from elastictrain.core import layout
from elastictrain.core.errors import SnapshotCorrupt, StorageError
from elastictrain.snapshot.format.manifest import SHARDED_FORMAT_VERSION, Manifest
from elastictrain.snapshot.format.reader import read_manifest
from elastictrain.storage import Store, open_store
from elastictrain.view import ops
from tests.fault_stores import _Wrapper
from tests.small_job import build, train


@pytest.fixture(params=["local", "memory"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "run")
    return f"memory://sharded-{os.getpid()}-{id(request)}"


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _saved_run(url: str, until: int = 10, mode: str = "async") -> None:
    """A run that ends after step ``until`` as a killed one does: no final save."""
    model, opt, sched, sampler, snap = build(url, sharded=True, mode=mode,
                                             save_on_close=False)
    train(model, opt, sched, sampler, snap, until)
    snap.close()


def _objects(store: Store, step: int, prefix: str) -> list[str]:
    return [n for n in store.list_dir(layout.step_dir(step)) if n.startswith(prefix)]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_resume_is_bit_exact(url: str, mode: str) -> None:
    ref = build(url + "-ref", sharded=True)
    ref_losses = train(*ref, until=14)
    ref[4].close()
    _saved_run(url, until=8, mode=mode)  # snapshot at 5 (train() ends the epoch after step 10)
    model, opt, sched, sampler, snap = build(url, sharded=True)
    info = snap.restore()
    losses = train(model, opt, sched, sampler, snap, until=14)
    snap.close()
    assert info.from_step == 5
    assert losses == ref_losses[5:]
    for got, want in zip(_params(model), _params(ref[0]), strict=True):
        assert torch.equal(got, want)


def test_manifest_lists_every_object_with_writer_rank_and_items(url: str) -> None:
    _saved_run(url)
    store = open_store(url)
    manifest = read_manifest(store, 10)
    assert manifest.format_version == SHARDED_FORMAT_VERSION
    names = {o.name for o in manifest.objects}
    assert names == set(store.list_dir(layout.step_dir(10))) - {layout.MANIFEST}
    (data,) = [o for o in manifest.objects if o.name.endswith(".distcp")]
    assert data.rank == 0 and data.items
    assert sum(i.length for i in data.items) == data.size_bytes
    assert ops.verify_snapshots(store)[0] == {"step": 10, "status": "ok",
                                              "size_bytes": manifest.total_bytes,
                                              "checksum": "crc32"}
    parts = ops.inspect_snapshot(store, 10)["parts"]
    assert parts == [{"rank": 0, "objects": 3, "items": len(data.items),
                      "size_bytes": manifest.total_bytes}]


def test_replicated_manifest_json_is_unchanged(tmp_path: Path) -> None:
    model, opt, sched, sampler, snap = build(str(tmp_path / "ddp"))
    train(model, opt, sched, sampler, snap, 5)
    snap.close()
    raw = open_store(str(tmp_path / "ddp")).read_bytes(f"{layout.step_dir(5)}/{layout.MANIFEST}")
    assert b'"rank"' not in raw and b'"items"' not in raw
    assert Manifest.from_json(raw, "x").format_version == 1


def test_missing_part_falls_back_to_previous_snapshot(url: str) -> None:
    _saved_run(url)
    store = open_store(url)
    (part,) = _objects(store, 10, "rank")
    store.delete(f"{layout.step_dir(10)}/{part}")
    rows = {r["step"]: r["status"] for r in ops.verify_snapshots(store)}
    assert rows == {10: "corrupt", 5: "ok"}
    *_, snap = build(url, sharded=True)
    with capture_logs() as logs:
        info = snap.restore()
    snap.close()
    assert info.from_step == 5
    skipped = [e for e in logs if e["event"] == "snapshot.corrupt"]
    assert skipped[0]["snapshot_step"] == 10 and part in skipped[0]["reason"]
    assert store.exists(f"{layout.step_dir(10)}/{layout.MANIFEST}")  # never deleted on read


def _flip_byte(store: Store, path: str, offset: int) -> None:
    data = bytearray(store.read_bytes(path))
    data[offset] ^= 0xFF
    store.delete(path)
    store.write_bytes(path, bytes(data))


def test_corrupt_item_falls_back_and_is_verified_per_item(url: str) -> None:
    _saved_run(url)
    store = open_store(url)
    (part,) = _objects(store, 10, "rank")
    item = read_manifest(store, 10).objects[0].items[-1]  # type: ignore[index]
    _flip_byte(store, f"{layout.step_dir(10)}/{part}", item.offset)
    *_, snap = build(url, sharded=True)
    with capture_logs() as logs:
        info = snap.restore()
    snap.close()
    assert info.from_step == 5
    reason = next(e["reason"] for e in logs if e["event"] == "snapshot.corrupt")
    assert f"item at offset {item.offset}" in reason


def test_corrupt_only_snapshot_after_partial_load_is_an_error(url: str) -> None:
    _saved_run(url, until=5)
    store = open_store(url)
    (part,) = _objects(store, 5, "rank")
    size = store.size(f"{layout.step_dir(5)}/{part}")
    _flip_byte(store, f"{layout.step_dir(5)}/{part}", size - 1)
    *_, snap = build(url, sharded=True)
    with pytest.raises(SnapshotCorrupt, match="partly loaded"):
        snap.restore()
    snap.close()


class _FailingReads(_Wrapper):
    """Reads of data objects fail as an unreachable store would."""

    @contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        if path.endswith(".distcp"):
            raise StorageError(f"{path}: connection reset")
        with self.inner.open_read(path) as f:
            yield f


def test_read_error_fails_the_attempt_without_fallback(url: str) -> None:
    _saved_run(url)
    store = _FailingReads(open_store(url))
    *_, snap = build(store, sharded=True)  # type: ignore[arg-type]
    with pytest.raises(StorageError, match="connection reset") as raised:
        snap.restore()
    snap.close()
    assert not isinstance(raised.value, SnapshotCorrupt)




def test_a_signed_sharded_snapshot_verifies_and_restores(url: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """With a signing key, sharded manifests are signed like replicated ones, so a run
    that sets the key can restore its own sharded snapshots (unsigned ones it refuses)."""
    monkeypatch.setenv("ELASTICTRAIN_SIGNING_KEY", "a-signing-key-of-some-length")
    _saved_run(url, until=8)
    assert read_manifest(open_store(url), 5).signature  # verified on read
    snap = build(url, sharded=True)[4]
    assert snap.restore().from_step == 5
    snap.close()
