"""A read error while restoring a sharded snapshot is no corruption (issue 24, case 5).

Throttling or a timeout on the size of a rank's part, on the DCP metadata or on the
training state fails the attempt (torchrun retries it); the newest snapshot is never
skipped for an older step, as in the replicated path. A missing object still is
corruption (tests/unit/snapshot/sharded/test_sharded_io.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import pytest
from structlog.testing import capture_logs

from elastictrain.core.errors import SnapshotCorrupt, StorageError, StorageTransientError
from elastictrain.storage import Store, open_store
from elastictrain.view import ops
from tests.fault_stores import _Wrapper
from tests.small_job import build, train


class _Throttled(_Wrapper):
    """``operation`` on paths containing ``match`` fails as a throttled request that
    outlived the store's retries."""

    def __init__(self, inner: Store, operation: str, match: str) -> None:
        super().__init__(inner)
        self.operation, self.match = operation, match
        self.failed = 0

    def _maybe_fail(self, operation: str, path: str) -> None:
        if operation == self.operation and self.match in path:
            self.failed += 1
            raise StorageTransientError(f"{path}: SlowDown (throttled) after retries")

    def size(self, path: str) -> int:
        self._maybe_fail("size", path)
        return self.inner.size(path)

    def read_bytes(self, path: str) -> bytes:
        self._maybe_fail("read_bytes", path)
        return self.inner.read_bytes(path)

    @contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        self._maybe_fail("open_read", path)
        with self.inner.open_read(path) as f:
            yield f


def _saved(url: str) -> None:
    model, opt, sched, sampler, snap = build(url, sharded=True)
    train(model, opt, sched, sampler, snap, 10)  # snapshots of steps 5 and 10
    snap.close()


@pytest.mark.parametrize(("operation", "match"), [
    ("size", ".distcp"),         # the cheap check that every part is there
    ("read_bytes", "dcp-"),      # the DCP metadata
    ("read_bytes", "train-"),    # the training state
])
def test_a_throttled_read_fails_the_attempt_instead_of_skipping_the_step(
        tmp_path: Path, operation: str, match: str) -> None:
    url = str(tmp_path / "run")
    _saved(url)
    store = _Throttled(open_store(url), operation, match)
    *_, snap = build(store, sharded=True)  # type: ignore[arg-type]
    with capture_logs() as logs, pytest.raises(StorageError, match="SlowDown") as raised:
        snap.restore()  # resumed step 5, silently, before
    snap.close()
    assert not isinstance(raised.value, SnapshotCorrupt)
    assert store.failed >= 1
    assert [e for e in logs if e["event"] == "snapshot.corrupt"] == []


def test_verify_raises_a_read_error_instead_of_reporting_corruption(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    _saved(url)
    store = _Throttled(open_store(url), "open_read", ".distcp")
    with pytest.raises(StorageError, match="SlowDown") as raised:
        ops.verify_snapshots(store)
    assert not isinstance(raised.value, SnapshotCorrupt)
