"""``snapshot.persist_max_mb_s``: a paced background persist writes no faster than the
rate (the write of N bytes lasts at least N / rate), for replicated and sharded state,
in the thread and the process persister, and the paced snapshot still restores exactly.
A synchronous save and the memory tier are not paced."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from elastictrain.config import SnapshotConfig
from elastictrain.snapshot.pacing import PacedWriter
from elastictrain.snapshot.reader import read_manifest
from elastictrain.snapshot.saver_interface import SaverSettings
from elastictrain.storage import open_store
from tests.unit.test_manager import build, train


class _FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_writes_ahead_of_the_rate_sleep_until_it_holds() -> None:
    time = _FakeTime()
    sink = io.BytesIO()
    paced = PacedWriter(sink, bytes_per_s=1000, clock=time.clock, sleep=time.sleep)
    for _ in range(4):
        paced.write(b"x" * 250)
    assert sink.getvalue() == b"x" * 1000
    assert time.now - 100.0 == pytest.approx(1.0)  # 1000 bytes at 1000 bytes/s


def test_writes_behind_the_rate_do_not_sleep() -> None:
    time = _FakeTime()
    paced = PacedWriter(io.BytesIO(), bytes_per_s=1000, clock=time.clock, sleep=time.sleep)
    paced.write(b"x" * 100)  # due at 0.1 s
    time.now += 0.5  # the writer itself took longer than the rate asks
    paced.write(b"x" * 100)  # due at 0.2 s, already 0.5 s in
    assert time.slept == [pytest.approx(0.1)]


def test_no_limit_is_the_sink_itself() -> None:
    sink = io.BytesIO()
    assert PacedWriter.wrap(sink, None) is sink
    with pytest.raises(ValueError, match="> 0"):
        PacedWriter(sink, 0)


def test_the_setting_reaches_the_durable_tier_only() -> None:
    config = SnapshotConfig(persist_max_mb_s=2.5)
    assert SaverSettings.for_durable(config).persist_max_bytes_per_s == 2.5e6
    assert SaverSettings.for_memory(config).persist_max_bytes_per_s is None
    assert SaverSettings.for_rescue(config).persist_max_bytes_per_s is None
    assert SaverSettings.for_durable(SnapshotConfig()).persist_max_bytes_per_s is None


def _paced_bytes(url: str, step: int) -> int:
    """The bytes of ``step`` written through the paced writer: the payload, or each
    rank's DCP part (the small metadata objects of a sharded snapshot are not paced)."""
    objects = read_manifest(open_store(url), step).objects
    return sum(o.size_bytes for o in objects
               if len(objects) == 1 or o.name.endswith(".distcp"))


def _commits(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "snapshot.committed"]


# 20 kB/s: the toy state's snapshots (a few kB each) take a measurable fraction of a
# second paced and a few milliseconds unpaced.
_RATE_MB_S = 0.02


@pytest.mark.parametrize(("sharded", "persister"),
                         [(False, "thread"),
                          pytest.param(False, "process", marks=pytest.mark.processes),
                          (True, "thread")])
def test_a_paced_persist_lasts_at_least_its_bytes_over_the_rate(
        tmp_path: Path, sharded: bool, persister: str) -> None:
    url = str(tmp_path / "run")
    with capture_logs() as logs:
        model, opt, sched, sampler, snap = build(url, sharded=sharded, persister=persister,
                                                 persist_max_mb_s=_RATE_MB_S)
        train(model, opt, sched, sampler, snap, until=8)
        snap.close()
    (commit,) = _commits(logs)
    assert commit["snapshot_step"] == 5
    floor_s = _paced_bytes(url, 5) / (_RATE_MB_S * 1e6)
    assert floor_s > 0.1
    assert commit["duration_s"] >= floor_s * 0.99  # duration_s is rounded to 0.1 ms
    ref = build(str(tmp_path / "ref"), sharded=sharded)
    ref_losses = train(*ref, until=9)
    ref[4].close()
    resumed = build(url, sharded=sharded)
    assert resumed[4].restore().from_step == 5
    assert train(*resumed, until=9) == ref_losses[5:]
    resumed[4].close()


def test_a_synchronous_save_is_not_paced(tmp_path: Path) -> None:
    with capture_logs() as logs:
        model, opt, sched, sampler, snap = build(str(tmp_path / "run"), mode="sync",
                                                 persist_max_mb_s=_RATE_MB_S)
        train(model, opt, sched, sampler, snap, until=5)
        snap.close()
    (commit,) = _commits(logs)
    assert commit["duration_s"] < commit["size_bytes"] / (_RATE_MB_S * 1e6) / 2
