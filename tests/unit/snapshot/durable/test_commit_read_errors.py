"""Case 4 (commit and retention side): a read that fails is not corruption. Nothing
committed is deleted because a check could not read it; only a verified mismatch
leads to replacement."""

from __future__ import annotations

import contextlib
import errno
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from elastictrain.core import layout
from elastictrain.core.errors import StorageError, StorageTransientError
from elastictrain.snapshot.durable.commit import persist_snapshot
from elastictrain.snapshot.durable.persister import SaveState, persist_with_retries
from elastictrain.snapshot.durable.retention import prune
from elastictrain.snapshot.format.manifest import SnapshotMeta
from elastictrain.snapshot.format.reader import list_snapshot_dirs, read_manifest, verify_snapshot
from elastictrain.storage import FsspecStore, Store, open_store
from elastictrain.storage.retry import RetryPolicy
from tests.fault_stores import FailingReads


def _meta(step: int) -> SnapshotMeta:
    return SnapshotMeta(run_id="t", step=step, epoch=0, world_size=1, checksum_algorithm="crc32")


def _payload(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((64,), value)}}


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> FsspecStore:
    url = str(tmp_path / "run") if request.param == "local" else f"memory://{uuid.uuid4().hex}"
    return open_store(url)


def _manifest_bytes(store: Store, step: int) -> bytes:
    return store.read_bytes(f"{layout.step_dir(step)}/{layout.MANIFEST}")


def test_failed_read_while_checking_a_committed_step_keeps_it(store: FsspecStore) -> None:
    persist_snapshot(store, _payload(1.0), _meta(10))
    before = _manifest_bytes(store, 10)
    with pytest.raises(StorageTransientError):
        persist_snapshot(FailingReads(store), _payload(2.0), _meta(10))
    assert _manifest_bytes(store, 10) == before  # the committed snapshot is untouched
    verify_snapshot(store, 10)


def test_the_persister_retries_after_a_failed_read_then_keeps_the_committed_step(
        store: FsspecStore) -> None:
    persist_snapshot(store, _payload(1.0), _meta(10))
    before = _manifest_bytes(store, 10)
    flaky = FailingReads(store, failures=1)
    outcome = persist_with_retries(flaky, _payload(2.0), _meta(10),
                                   RetryPolicy(max_consecutive_failures=3, backoff_s=0.001))
    assert flaky.failed == 1
    assert (outcome.state, outcome.attempts) == (SaveState.SKIPPED, 2)
    assert _manifest_bytes(store, 10) == before


def test_a_verified_mismatch_is_still_replaced(store: FsspecStore) -> None:
    persist_snapshot(store, _payload(1.0), _meta(10))
    name = read_manifest(store, 10).objects[0].name
    path = f"{layout.step_dir(10)}/{name}"
    data = bytearray(store.read_bytes(path))
    data[-100] ^= 0xFF
    store.delete(path)
    store.write_bytes(path, bytes(data))
    assert persist_snapshot(store, _payload(2.0), _meta(10)) is not None
    verify_snapshot(store, 10)


def _failing_info(store: FsspecStore, monkeypatch: pytest.MonkeyPatch, fragment: str) -> None:
    """``fs.info`` on paths containing ``fragment`` fails as a denied or broken stat does."""
    real = store.fs.info

    def info(path: str, **kwargs: Any) -> Any:
        if fragment in path:
            raise OSError(errno.EACCES, "injected: access denied")
        return real(path, **kwargs)

    monkeypatch.setattr(store.fs, "info", info)


def test_exists_raises_instead_of_answering_absent_when_the_check_fails(
        store: FsspecStore, monkeypatch: pytest.MonkeyPatch) -> None:
    persist_snapshot(store, _payload(1.0), _meta(10))
    _failing_info(store, monkeypatch, layout.MANIFEST)
    with pytest.raises(StorageError):
        store.exists(f"{layout.step_dir(10)}/{layout.MANIFEST}")


def test_retention_never_prunes_a_committed_step_whose_check_failed(
        store: FsspecStore, monkeypatch: pytest.MonkeyPatch) -> None:
    for step in (10, 20, 30):
        persist_snapshot(store, _payload(float(step)), _meta(step))
    marker = f"{layout.step_dir(10)}/{layout.MANIFEST}"
    _failing_info(store, monkeypatch, marker)  # a file system stats the marker,
    with pytest.raises(StorageError):  # an object store reads it
        prune(FailingReads(store, marker), keep=3, newest_step=30)
    monkeypatch.undo()
    assert list_snapshot_dirs(store) == [30, 20, 10]
    verify_snapshot(store, 10)


def test_retention_keeps_payloads_when_the_manifest_read_fails(store: FsspecStore) -> None:
    persist_snapshot(store, _payload(1.0), _meta(10))
    named = {o.name for o in read_manifest(store, 10).objects}
    with contextlib.suppress(StorageError):  # an object store reads the marker too
        prune(FailingReads(store), keep=1, newest_step=10)
    left = set(store.list_dir(layout.step_dir(10)))
    assert named <= left
    verify_snapshot(store, 10)
