"""A preemption notice while a sharded save fails, in one process (DCP without a process
group): the failed save is reported, the final sharded snapshot is still taken, and it
commits: exit 75 (the two-rank case that ends 76 is
tests/processes/sharded/test_fsdp_preempt.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import pytest
import torch
from structlog.testing import capture_logs

from elastictrain.core.config import PreemptConfig
from elastictrain.core.errors import EXIT_PREEMPTED, StorageError
from elastictrain.snapshot.format.reader import list_snapshot_dirs
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.storage import open_store
from elastictrain.worker import preempt
from tests.fault_stores import _Wrapper


class _FirstPartFails(_Wrapper):
    """The first write of a rank's part (``*.distcp``) raises, later ones succeed."""

    failed = False

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        if path.endswith(".distcp") and not self.failed:
            self.failed = True
            raise StorageError(f"write {self.inner.url}/{path}: injected failure")
        with self.inner.open_write(path) as sink:
            yield sink


def test_notice_after_a_failed_sharded_save_takes_the_final_one_and_exits_75(
        tmp_path: Path) -> None:
    watcher = preempt.install(PreemptConfig(signals=[]), poll=False)
    assert watcher is not None
    try:
        store = _FirstPartFails(open_store(str(tmp_path)))
        snap = SnapshotManager(store, model=torch.nn.Linear(3, 3),  # type: ignore[arg-type]
                               every_steps=5, sharded=True, mode="sync")
        with capture_logs() as logs:
            while snap.step_count < 5:
                snap.step()  # the save of step 5 fails (sync: before step() returns)
            watcher.notify("signal", "SIGTERM")  # agreed at step 6, with the failure
            with pytest.raises(SystemExit) as exited:
                snap.step()
    finally:
        preempt.uninstall()
    assert exited.value.code == EXIT_PREEMPTED
    assert list_snapshot_dirs(open_store(str(tmp_path))) == [6]  # the final one committed
    events = [e["event"] for e in logs]
    assert "preempt.inflight_failed" in events and "preempt.saved" in events
    assert [e["snapshot_step"] for e in logs if e["event"] == "snapshot.failed"] == [5]
