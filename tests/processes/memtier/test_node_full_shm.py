"""Issue 24, case 8: the node's memory directory fills up (a real 8 MiB tmpfs filled by
a filler file). Training goes on with durable snapshots, the memory tier and the
rescue say once that they are degraded, nothing is retried with a back-off, and both
come back when space returns."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from elastictrain.snapshot.format.reader import list_snapshot_dirs
from elastictrain.storage import open_store
from elastictrain.view.model import RunState
from tests.small_job import build, train

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small tmpfs")


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "shm"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)  # a straggler may hold a file


def fill(path: Path) -> None:
    """Write a filler file until the tmpfs refuses another byte."""
    with open(path / "filler", "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC


@pytest.mark.processes
def test_full_memory_dir_degrades_and_recovers(tmp_path: Path, small_tmpfs: Path,
                                               request: pytest.FixtureRequest) -> None:
    parts = build(str(tmp_path / "run"), memory_every=1, memory_dir=str(small_tmpfs / "mem"))
    snap = parts[4]
    request.addfinalizer(snap.close)  # before the tmpfs is unmounted (fixture order)
    snap.restore()
    fill(small_tmpfs)
    with capture_logs() as logs:
        train(*parts, until=7)  # a boundary record and memory saves on a full tmpfs
        snap.wait()
    assert list_snapshot_dirs(open_store(str(tmp_path / "run"))) == [5]  # durable goes on
    degraded = {e["what"] for e in logs if e["event"] == "snapshot.memory_degraded"}
    assert degraded == {"rescue boundary record", "memory snapshot"}
    view = RunState()  # what the live view and status show of these events
    for event in logs:
        view.apply(event)
    assert set(view.memory_degraded) == degraded
    assert sorted(line.text.split(":")[0] for line in view.lines if line.kind == "memory") \
        == [f"node memory tier off ({what})" for what in sorted(degraded)]
    retried = [e for e in logs if e["event"] == "snapshot.failed" and e["will_retry"]]
    assert not retried  # no back-off for the next memory save to wait out
    (small_tmpfs / "filler").unlink()
    with capture_logs() as logs:
        train(*parts, until=9)
        snap.wait()
    recovered = {e["what"] for e in logs if e["event"] == "snapshot.memory_recovered"}
    assert recovered == degraded
    for event in logs:
        view.apply(event)
    assert view.memory_degraded == {}
    assert sum(line.text.startswith("node memory tier back") for line in view.lines) == 2
    assert list_snapshot_dirs(open_store(str(small_tmpfs / "mem")))[0] == 9
    snap.close()
    assert os.listdir(small_tmpfs) == []
