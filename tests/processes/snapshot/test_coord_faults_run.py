"""A slow persist in the process persister that keeps moving is not a hang."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from elastictrain.snapshot.format.reader import list_snapshot_dirs
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.storage import open_store
from tests.fault_stores import TricklingStore
from tests.unit.snapshot.test_coord_faults import named


# -- case 3: the watchdog while waiting for a persist --------------------------------------
@pytest.mark.processes
@pytest.mark.parametrize("persister", ["thread", "process"])
def test_a_slow_persist_that_keeps_moving_is_not_a_hang(
        tmp_path: Path, watchdog_exits: Callable[[], list[int]], persister: str) -> None:
    # 4 MB at 32 KiB per 20 ms: about 2.6 s of upload, five times the 0.5 s limit.
    store = TricklingStore(open_store(str(tmp_path)), chunk_bytes=32 << 10, delay_s=0.02)
    snap = SnapshotManager(store, model=torch.nn.Linear(1024, 1024), every_steps=1,
                           persister=persister)
    snap.step()
    snap.wait()  # a persister process is up (it imports torch for seconds: not measured here)
    exits = watchdog_exits()
    with capture_logs() as logs:
        snap.step()
        snap.close()  # waits for the whole upload
    assert exits == [] and list_snapshot_dirs(snap.store) == [2, 1]
    (committed,) = named(logs, "snapshot.committed")
    assert committed["duration_s"] > 1.0  # the upload did outlast the limit


