"""A restore checked for sense (snapshot/state/sense_check.py, snapshot/fallback.py,
durable/suspects.py): snapshots whose bytes verify but whose state makes no sense (NaN
weights, a diverged model), planted into a committed snapshot with a valid checksum,
are set aside (kept, moved out of ``snapshots/``) and the next restore falls back to
the snapshot before; too many in a row, or nothing to fall back to, stop with 78."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from elastictrain.core import layout
from elastictrain.core.errors import SnapshotSuspect, SuspectLimit
from elastictrain.snapshot.durable.suspects import SuspectRecord, in_a_row, set_aside, suspects
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.snapshot.state.sense_check import RestoreWatch, all_finite
from elastictrain.storage import open_store
from elastictrain.view.ops import list_snapshots
from elastictrain.worker.dist import DistContext
from tests.planted import plant_snapshot, rewrite_payload

ONE = DistContext(0, 1, 0, "gloo", torch.device("cpu"), False)


# -- the watch ------------------------------------------------------------------------
def test_a_restored_tensor_that_is_not_finite_is_senseless_at_once() -> None:
    watch = RestoreWatch(ONE, steps=5, loss_factor=4)
    seen = watch.restored(10, "durable", 1.0, [torch.ones(3), torch.tensor([1.0, math.nan])])
    assert seen is not None and "not finite" in seen.reason and seen.snapshot.step == 10
    assert not watch.active
    assert watch.restored(10, "durable", 1.0, [torch.ones(3)]) is None and watch.active


def test_a_nonfinite_loss_shows_at_its_step() -> None:
    watch = RestoreWatch(ONE, steps=5, loss_factor=4)
    watch.restored(10, "durable", 1.0, [torch.ones(2)])
    assert watch.observe(11, torch.tensor(1.1), list) is None
    seen = watch.observe(12, torch.tensor(math.inf), list)
    assert seen is not None and seen.at_step == 12 and "loss is not finite" in seen.reason
    assert watch.observe(13, math.nan, list) is None  # the window is over


def test_a_loss_far_above_the_recorded_one_shows_once_the_window_holds_enough() -> None:
    watch = RestoreWatch(ONE, steps=4, loss_factor=4)
    watch.restored(10, "memory", 0.5, [torch.ones(2)])
    losses = [30.0, 0.4, 25.0, 20.0]  # one good batch does not hide it: the median
    seen = [watch.observe(11 + i, loss, list) for i, loss in enumerate(losses)]
    assert seen[:3] == [None, None, None]
    assert seen[3] is not None and seen[3].at_step == 14 and "45x" in seen[3].reason  # median 22.5
    assert seen[3].snapshot.tier == "memory" and seen[3].snapshot.recorded_loss == 0.5


def test_a_loss_near_the_recorded_one_passes_and_the_watch_ends() -> None:
    watch = RestoreWatch(ONE, steps=3, loss_factor=4)
    watch.restored(10, "durable", 1.0, [torch.ones(2)])
    assert [watch.observe(s, 3.5, list) for s in (11, 12, 13)] == [None, None, None]
    assert not watch.active


def test_without_a_loss_the_tensors_are_checked_at_the_windows_end() -> None:
    watch = RestoreWatch(ONE, steps=2, loss_factor=4)
    weights = torch.ones(3)
    watch.restored(10, "durable", None, [weights])
    assert watch.observe(11, None, lambda: [weights]) is None
    weights[1] = math.nan  # gone wrong while training on
    seen = watch.observe(12, None, lambda: [weights])
    assert seen is not None and "parameter or optimizer state is not finite" in seen.reason


def test_no_ratio_without_a_positive_recorded_loss_and_no_watch_at_zero_steps() -> None:
    watch = RestoreWatch(ONE, steps=1, loss_factor=4)
    watch.restored(10, "durable", -2.0, [torch.ones(1)])
    assert watch.observe(11, 100.0, list) is None
    off = RestoreWatch(ONE, steps=0, loss_factor=4)
    assert off.restored(10, "durable", 1.0, [torch.tensor([math.nan])]) is None
    assert not off.active


def test_all_finite_ignores_integer_tensors_and_empty_ones() -> None:
    assert all_finite([torch.arange(3), torch.empty(0), torch.ones(2)])
    assert not all_finite([torch.tensor([1.0, -math.inf])])


# -- setting aside ----------------------------------------------------------------------
def _record(step: int, **kw: Any) -> SuspectRecord:
    return SuspectRecord(step=step, tier="durable", reason="test", at_step=step + 3,
                         loss=None, recorded_loss=None, run_id="r", launch_id=None, **kw)


@pytest.mark.parametrize("url", ["local", "memory://suspects-test"])
def test_a_suspect_snapshot_moves_whole_out_of_snapshots_and_is_kept(
        tmp_path: Path, url: str) -> None:
    store = open_store(str(tmp_path / "run") if url == "local" else url)
    for step in (5, 10):
        plant_snapshot(store, step, {"step": step, "w": torch.ones(4) * step})
    names = store.list_dir(layout.step_dir(10))
    written = set_aside(store, _record(10))
    assert written.moved_to is not None and written.time
    assert sorted(store.list_dir(written.moved_to)) == sorted(names)
    assert not store.exists(layout.step_dir(10))
    assert suspects(store) == [written]
    in_row, head = in_a_row(store)
    assert in_row == [written] and head == 5
    descendant = set_aside(store, _record(5, descends_from=3))
    assert in_a_row(store) == ([written], None)  # descendants are not counted
    assert descendant in suspects(store)
    if url != "local":
        store.delete("", recursive=True)


def test_a_record_without_a_durable_copy_moves_nothing(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "run"))
    written = set_aside(store, _record(7, ))
    assert written.moved_to is None and suspects(store) == [written]


# -- the whole path, in a manager -------------------------------------------------------
def _job(url: str, **kw: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                       SnapshotManager]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    snap = SnapshotManager(url, model=model, optimizer=opt, mode="sync",
                           **{"every_steps": 5, "keep": 5, "check_steps": 4, **kw})
    return model, opt, snap


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, snap: SnapshotManager,
           until: int) -> None:
    gen = torch.Generator().manual_seed(snap.step_count)
    while snap.step_count < until:
        x = torch.randn(16, 8, generator=gen)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        snap.step(loss=loss)


def _plant(url: str, step: int, change: Any) -> None:
    """The committed snapshot of ``step`` with ``change`` applied to its model, checksummed
    anew: its bytes verify, its state does not make sense."""
    rewrite_payload(open_store(url), step, change)


def _trained(url: str, until: int) -> None:
    """A run of the job to ``until`` (a snapshot every 5 steps), closed."""
    model, opt, snap = _job(url)
    _train(model, opt, snap, until)
    snap.close()


def test_nan_weights_in_a_committed_snapshot_fall_back_to_the_one_before(
        tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    _trained(url, 15)
    assert open_store(url).read_bytes(f"{layout.step_dir(15)}/{layout.MANIFEST}").find(
        b'"loss"') > 0  # recorded with the snapshot
    _plant(url, 15, lambda name, t: t.fill_(math.nan) if name == "0.weight" else t)
    model, opt, snap = _job(url)
    with pytest.raises(SnapshotSuspect, match=r"restore of step 15 .*not finite"):
        snap.restore()
    store = open_store(url)
    [record] = suspects(store)
    assert record.step == 15 and record.moved_to and store.exists(record.moved_to)
    listed = [(row["step"], row["status"]) for row in list_snapshots(store)]
    assert listed == [(15, "suspect"), (10, "unverified"), (5, "unverified")]
    model, opt, snap = _job(url)  # the restart
    assert snap.restore().from_step == 10
    _train(model, opt, snap, 20)  # the watch passes: training goes on and saves again
    snap.close()
    assert in_a_row(open_store(url)) == ([], 20)


def test_a_diverged_snapshot_is_found_by_its_loss_with_what_it_saved_since(
        tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    _trained(url, 15)
    _plant(url, 15, lambda name, t: t * 40)  # verifies, trains, but far off
    model, opt, snap = _job(url, every_steps=2)
    assert snap.restore().from_step == 15
    with pytest.raises(SnapshotSuspect, match=r"loss after the restore is .*x the"):
        _train(model, opt, snap, 30)
    assert snap.step_count == 19  # 4 steps watched (a window of 4: its median at once)
    found = {r.step: r.descends_from for r in suspects(open_store(url))}
    assert found == {15: None, 16: 15, 18: 15}  # taken since the restore: set aside too
    model, opt, snap = _job(url)
    assert snap.restore().from_step == 10


def test_more_suspects_in_a_row_than_allowed_stop_with_78(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    _trained(url, 15)
    for step in (10, 15):
        _plant(url, step, lambda name, t: t.fill_(math.nan))
    *_, snap = _job(url, check_max_fallbacks=1)
    with pytest.raises(SnapshotSuspect):
        snap.restore()
    *_, snap = _job(url, check_max_fallbacks=1)
    with pytest.raises(SuspectLimit, match=r"2 snapshots in a row .*steps 10, 15") as error:
        snap.restore()
    assert error.value.exit_code == 78


def test_nothing_older_to_fall_back_to_stops_with_78(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    _trained(url, 5)
    _plant(url, 5, lambda name, t: t.fill_(math.inf))
    *_, snap = _job(url)
    with pytest.raises(SuspectLimit, match="no earlier snapshot"):
        snap.restore()


def test_the_check_can_be_turned_off(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    _trained(url, 10)
    _plant(url, 10, lambda name, t: t.fill_(math.nan))
    *_, snap = _job(url, check_steps=0)
    assert snap.restore().from_step == 10


def test_the_median_is_compared_from_the_fifth_step_of_a_long_window() -> None:
    watch = RestoreWatch(ONE, steps=20, loss_factor=4)
    watch.restored(10, "durable", 1.0, [torch.ones(2)])
    seen = [watch.observe(11 + i, loss, list) for i, loss in enumerate([9.0] * 6)]
    assert seen[:4] == [None] * 4 and seen[4] is not None and seen[4].at_step == 15
    assert not watch.active


@pytest.mark.usefixtures("one_rank_group")
def test_a_sharded_snapshot_is_set_aside_whole_and_the_one_before_restores(
        tmp_path: Path) -> None:
    """FSDP2 (DTensor) state: the restored shards are checked, a loss far above the
    recorded one sets the sharded snapshot aside (every rank's objects, moved as one
    directory) and the next restore loads the one before."""
    from tests.small_job import one_rank_fsdp2

    url = str(tmp_path / "run")

    def job() -> tuple[torch.nn.Module, torch.optim.Optimizer, SnapshotManager]:
        model, opt = one_rank_fsdp2(8, 8)
        return model, opt, SnapshotManager(url, model=model, optimizer=opt, mode="sync",
                                           every_steps=5, keep=5, check_steps=5)

    model, opt, snap = job()
    assert snap.sharded
    _train(model, opt, snap, 10)
    snap.close()
    model, opt, snap = job()
    assert snap.restore().from_step == 10
    names = sorted(open_store(url).list_dir(layout.step_dir(10)))
    with pytest.raises(SnapshotSuspect, match="loss after the restore"):
        for _ in range(5):  # a loss far above what was recorded, step after step
            snap.step(loss=1e6)
    store = open_store(url)
    [record] = suspects(store)
    assert record.step == 10 and sorted(store.list_dir(record.moved_to or "")) == names
    model, opt, snap = job()
    assert snap.restore().from_step == 5
    snap.close()
