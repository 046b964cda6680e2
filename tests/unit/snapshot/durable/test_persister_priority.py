"""``snapshot.persister_priority="low"``: the persist thread runs at nice +10 and the
lowest best-effort I/O priority; the training thread keeps its own."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch

from elastictrain.snapshot.durable.persist_thread import ThreadPersister
from elastictrain.snapshot.durable.persister import Background, lower_priority
from elastictrain.snapshot.format.manifest import SnapshotMeta
from elastictrain.storage import open_store
from elastictrain.storage.retry import RetryPolicy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="thread priorities are Linux's")


def _nice(tid: int) -> int:
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])  # field 19: nice


def test_low_lowers_only_the_calling_thread() -> None:
    main = threading.get_native_id()
    before = _nice(main)
    seen: dict[str, int] = {}

    def background() -> None:
        lower_priority("low")
        seen["tid"] = threading.get_native_id()
        seen["nice"] = _nice(seen["tid"])
        child = threading.Thread(target=lambda: seen.update(child=_nice(
            threading.get_native_id())))
        child.start()
        child.join()

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen["nice"] == min(before + 10, 19)
    assert seen["child"] == seen["nice"]  # threads it starts (S3 uploads) inherit it
    assert _nice(main) == before


def test_normal_changes_nothing() -> None:
    before = _nice(threading.get_native_id())
    lower_priority("normal")
    assert _nice(threading.get_native_id()) == before


def test_thread_persister_persists_at_low_priority(tmp_path: Path) -> None:
    before = _nice(threading.get_native_id())
    persister = ThreadPersister(open_store(str(tmp_path)), keep=1,
                                policy=RetryPolicy(1, 0.01), background=Background("low"))
    try:
        meta = SnapshotMeta(run_id="r", step=1, epoch=0, world_size=1,
                            checksum_algorithm="crc32")
        assert persister.submit({"w": torch.ones(4)}, meta).wait() is not None
        tid = persister._thread.native_id
        assert tid is not None and _nice(tid) == min(before + 10, 19)
    finally:
        persister.close()
    assert _nice(threading.get_native_id()) == before
    assert os.listdir(tmp_path / "snapshots")
