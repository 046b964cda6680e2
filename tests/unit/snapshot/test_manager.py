"""SnapshotManager in one process: exact resume of model, optimizer, scheduler,
scaler, sampler, RNG and extras; retention; what a fresh start reports."""

from __future__ import annotations

from pathlib import Path

import torch
from structlog.testing import capture_logs

from elastictrain.snapshot.format.reader import list_snapshot_dirs
from tests.small_job import build, train


def test_resume_is_bit_exact(tmp_path: Path) -> None:
    ref = build(str(tmp_path / "ref"))
    ref_losses = train(*ref, until=23)
    ref[4].close()
    # Ends as a process that dies after step 17 does: without close()'s final save.
    interrupted = build(str(tmp_path / "run"), save_on_close=False)
    train(*interrupted, until=17)  # last snapshot at 15: steps 16, 17 are lost
    interrupted[4].close()
    resumed = build(str(tmp_path / "run"), progress_dir=tmp_path / "progress")
    info = resumed[4].restore()
    assert info.from_step == 15 and resumed[4].step_count == 15
    losses = train(*resumed, until=23)
    resumed[4].close()
    assert losses == ref_losses[15:]
    for a, b in zip(ref[0].state_dict().values(), resumed[0].state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert resumed[1].state_dict()["state"][0]["step"] == ref[1].state_dict()["state"][0]["step"]
    assert resumed[3].state_dict() == ref[3].state_dict()


def test_extras_round_trip_and_retention(tmp_path: Path) -> None:
    model, opt, sched, sampler, snap = build(str(tmp_path))
    snap.extras["best_loss"] = 0.25
    snap.extras["history"] = [1, 2, 3]
    train(model, opt, sched, sampler, snap, until=20)
    snap.close()
    assert list_snapshot_dirs(snap.store) == [20, 15]  # keep=2
    *_, again = build(str(tmp_path))
    again.restore()
    assert again.extras == {"best_loss": 0.25, "history": [1, 2, 3]}


def test_fresh_start_reports_no_resume(tmp_path: Path) -> None:
    *_, snap = build(str(tmp_path))
    with capture_logs() as logs:
        info = snap.restore()
    assert not info.resumed and info.from_step is None and snap.step_count == 0
    (resume,) = [e for e in logs if e["event"] == "resume"]
    assert resume["from_step"] is None


def test_lost_steps_come_from_progress_marker(tmp_path: Path) -> None:
    first = build(str(tmp_path / "run"), progress_dir=tmp_path / "p", save_on_close=False)
    train(*first, until=13)
    first[4].close()
    *_, snap = build(str(tmp_path / "run"), progress_dir=tmp_path / "p")
    with capture_logs() as logs:
        info = snap.restore()
    assert (info.from_step, info.lost_steps) == (10, 3)
    (resume,) = [e for e in logs if e["event"] == "resume"]
    assert resume["lost_steps"] == 3


def test_lost_steps_count_another_ranks_marker_on_this_node(tmp_path: Path) -> None:
    """After a node is replaced the rendezvous may swap ranks: the worker that ran as
    rank 1 here comes back as rank 0, and still reports the steps this node lost."""
    first = build(str(tmp_path / "run"), progress_dir=tmp_path / "p", save_on_close=False)
    train(*first, until=13)
    first[4].close()
    (tmp_path / "p" / "progress-rank0").rename(tmp_path / "p" / "progress-rank1")
    *_, snap = build(str(tmp_path / "run"), progress_dir=tmp_path / "p")
    assert snap.restore().lost_steps == 3


def test_close_saves_the_last_step_once_and_a_relaunch_trains_nothing(tmp_path: Path) -> None:
    """The run ends at step 13 (snapshots every 5): close() commits 13 and names it in
    run.finished; the same run again resumes at 13 and, training nothing, saves
    nothing more; with save_on_close off the newest stays 10."""
    url = str(tmp_path / "run")
    first = build(url)
    train(*first, until=13)
    with capture_logs() as logs:
        first[4].close()
    assert list_snapshot_dirs(first[4].store) == [13, 10]
    (finished,) = [e for e in logs if e["event"] == "run.finished"]
    assert (finished["final_step"], finished["snapshot_step"]) == (13, 13)
    again = build(url)
    with capture_logs() as logs:
        assert again[4].restore().from_step == 13
    (said,) = [e for e in logs if e["event"] == "resume.run_finished"]  # and says so
    assert said["snapshot_step"] == 13 and "already ended at step 13" in said["message"]
    with capture_logs() as logs:
        train(*again, until=13)  # the loop's end is reached: no step
        again[4].close()
    assert not [e for e in logs if e["event"].startswith("snapshot.")], logs
    (finished,) = [e for e in logs if e["event"] == "run.finished"]
    assert finished["snapshot_step"] == 13

    off = str(tmp_path / "off")
    unsaved = build(off, save_on_close=False)
    train(*unsaved, until=13)
    with capture_logs() as logs:
        unsaved[4].close()
    assert list_snapshot_dirs(unsaved[4].store) == [10, 5]
    (finished,) = [e for e in logs if e["event"] == "run.finished"]
    assert finished["snapshot_step"] == 10
    resumed = build(off)
    with capture_logs() as logs:  # a periodic snapshot is no end: nothing said
        assert resumed[4].restore().from_step == 10
    assert not [e for e in logs if e["event"] == "resume.run_finished"]
    resumed[4].close()


def test_close_while_an_error_propagates_saves_no_last_step(tmp_path: Path) -> None:
    """close() in a ``finally`` around a loop that raised mid-step: the parameters may
    be half-updated, so no snapshot is labelled with the last counted step."""
    model, opt, sched, sampler, snap = build(str(tmp_path / "run"))
    train(model, opt, sched, sampler, snap, until=13)
    try:
        try:
            raise RuntimeError("a step failed half-way")
        finally:
            snap.close()
    except RuntimeError:
        pass
    assert list_snapshot_dirs(snap.store) == [10, 5]
