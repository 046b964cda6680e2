"""``snapshot.persist_max_mb_s``: a paced background persist writes no faster than the
rate (the write of N bytes lasts at least N / rate), for replicated and sharded state,
in the thread and the process persister, and the paced snapshot still restores exactly.
A synchronous save and the memory tier are not paced; a run that ends (``close``, a
preemption notice) lifts the pace for the save in flight and the final one."""
from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from elastictrain.core.config import SnapshotConfig
from elastictrain.core.errors import EXIT_PREEMPTED
from elastictrain.snapshot.durable.pacing import Pace, PacedWriter
from elastictrain.snapshot.durable.saver_interface import SaverSettings
from elastictrain.snapshot.format.reader import list_snapshot_dirs, read_manifest
from elastictrain.storage import open_store
from elastictrain.worker import preempt
from tests.small_job import build, train


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
    paced = PacedWriter(sink, Pace(1000), clock=time.clock, sleep=time.sleep)
    for _ in range(4):
        paced.write(b"x" * 250)
    assert sink.getvalue() == b"x" * 1000
    assert time.now - 100.0 == pytest.approx(1.0)  # 1000 bytes at 1000 bytes/s


def test_writes_behind_the_rate_do_not_sleep() -> None:
    time = _FakeTime()
    paced = PacedWriter(io.BytesIO(), Pace(1000), clock=time.clock, sleep=time.sleep)
    paced.write(b"x" * 100)  # due at 0.1 s
    time.now += 0.5  # the writer itself took longer than the rate asks
    paced.write(b"x" * 100)  # due at 0.2 s, already 0.5 s in
    assert time.slept == [pytest.approx(0.1)]


def test_a_lifted_pace_writes_at_full_speed_from_the_next_write_on() -> None:
    time = _FakeTime()
    pace = Pace(1000)
    paced = PacedWriter(io.BytesIO(), pace, clock=time.clock, sleep=time.sleep)
    paced.write(b"x" * 500)
    pace.lift()
    paced.write(b"x" * 5000)
    assert time.slept == [pytest.approx(0.5)]  # the first write only


def test_no_pace_is_the_sink_itself() -> None:
    sink = io.BytesIO()
    assert PacedWriter.wrap(sink, None) is sink
    with pytest.raises(ValueError, match="> 0"):
        Pace(0)


def test_the_setting_reaches_the_durable_tier_only() -> None:
    config = SnapshotConfig(persist_max_mb_s=2.5)
    assert SaverSettings.for_durable(config).persist_max_bytes_per_s == 2.5e6
    assert SaverSettings.for_memory(config).persist_max_bytes_per_s is None
    assert SaverSettings.for_rescue(config).persist_max_bytes_per_s is None
    assert SaverSettings.for_durable(SnapshotConfig()).persist_max_bytes_per_s is None


def _commits(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "snapshot.committed"]


# 100 kB/s: the toy state's snapshots (about 20 kB) take a measurable fraction of a
# second paced and a few milliseconds unpaced.
_RATE_MB_S = 0.1
def test_a_synchronous_save_is_not_paced(tmp_path: Path) -> None:
    with capture_logs() as logs:
        model, opt, sched, sampler, snap = build(str(tmp_path / "run"), mode="sync",
                                                 persist_max_mb_s=_RATE_MB_S)
        train(model, opt, sched, sampler, snap, until=5)
        snap.close()
    (commit,) = _commits(logs)
    assert commit["duration_s"] < commit["size_bytes"] / (_RATE_MB_S * 1e6) / 2


# 100 B/s: a save of the toy state (about 20 kB) would take some 200 s paced, far
# above a full-speed close even on a loaded machine (a process persister took 6.7 s).
_CRAWL_MB_S = 0.0001
def test_a_preemption_notice_lifts_the_pace(tmp_path: Path,
                                            watcher: preempt.PreemptionWatcher) -> None:
    """The save in flight and the final one go at full speed once a notice is agreed:
    the grace period, not the loop, is what counts then."""
    model, opt, sched, sampler, snap = build(str(tmp_path / "run"),
                                             persist_max_mb_s=_CRAWL_MB_S)
    train(model, opt, sched, sampler, snap, until=6)  # the save of step 5 is in flight
    watcher.notify("file", "/notice")
    with capture_logs() as logs, pytest.raises(SystemExit) as exited:
        train(model, opt, sched, sampler, snap, until=7)
    assert exited.value.code == EXIT_PREEMPTED
    commits = _commits(logs)
    assert [e["snapshot_step"] for e in commits] == [5, 7]
    floor_s = commits[1]["size_bytes"] / (_CRAWL_MB_S * 1e6)
    (saved,) = [e for e in logs if e["event"] == "preempt.saved"]
    assert saved["duration_s"] < floor_s / 4
    assert list_snapshot_dirs(open_store(str(tmp_path / "run"))) == [7, 5]


def _paced_bytes(url: str, step: int) -> int:
    """The bytes of ``step`` written through the paced writer: the payload, or each
    rank's DCP part (the small metadata objects of a sharded snapshot are not paced)."""
    objects = read_manifest(open_store(url), step).objects
    return sum(o.size_bytes for o in objects
               if len(objects) == 1 or o.name.endswith(".distcp"))


def check_a_paced_persist(tmp_path: Path, *, sharded: bool, persister: str) -> None:
    """A paced persist lasts at least its bytes over the rate; it restores exactly."""
    url = str(tmp_path / "run")
    with capture_logs() as logs:
        model, opt, sched, sampler, snap = build(url, sharded=sharded, persister=persister,
                                                 persist_max_mb_s=_RATE_MB_S,
                                                 save_on_close=False)  # as if killed at 8
        train(model, opt, sched, sampler, snap, until=8)
        snap.wait()  # at the pace: close() would lift it
        snap.close()
    (commit,) = _commits(logs)
    assert commit["snapshot_step"] == 5
    floor_s = _paced_bytes(url, 5) / (_RATE_MB_S * 1e6)
    assert floor_s > 0.1
    assert commit["duration_s"] >= floor_s * 0.99  # duration_s is rounded to 0.1 ms
    ref = build(str(tmp_path / "ref"), sharded=sharded)  # not paced: same results
    ref_losses = train(*ref, until=9)
    ref[4].close()
    resumed = build(url, sharded=sharded)
    assert resumed[4].restore().from_step == 5
    assert train(*resumed, until=9) == ref_losses[5:]
    resumed[4].close()


def check_close_at_full_speed(tmp_path: Path, persister: str) -> None:
    """close() finishes a paced save in flight at full speed."""
    model, opt, sched, sampler, snap = build(str(tmp_path / "run"), persister=persister,
                                             persist_max_mb_s=_CRAWL_MB_S)
    train(model, opt, sched, sampler, snap, until=5)  # the save of step 5 is in flight
    with capture_logs() as logs:
        started = time.monotonic()
        snap.close()
        closed_s = time.monotonic() - started
    (commit,) = _commits(logs)
    assert commit["snapshot_step"] == 5
    assert closed_s < commit["size_bytes"] / (_CRAWL_MB_S * 1e6) / 4




@pytest.mark.parametrize("sharded", [False, True])
def test_a_paced_persist_lasts_at_least_its_bytes_over_the_rate(tmp_path: Path,
                                                               sharded: bool) -> None:
    check_a_paced_persist(tmp_path, sharded=sharded, persister="thread")


def test_close_finishes_a_paced_save_at_full_speed(tmp_path: Path) -> None:
    check_close_at_full_speed(tmp_path, "thread")
