"""Rescue in one process: the boundary record (round trip, slots, torn or foreign
records), the version check, the one-writer lock, and the manager's rescue after a
failed step: bit-exact when the state is still the last boundary's, skipped (and the
restart uses the periodic snapshots) when it is not, when a rank's record is torn, or
when the rescue's own write fails."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from elastictrain import runtime
from elastictrain.core import layout
from elastictrain.snapshot.format.reader import list_snapshot_dirs
from elastictrain.snapshot.memory import rescue
from elastictrain.snapshot.state.rng import restore_rng
from elastictrain.storage import open_store
from tests.small_job import build, train

ATTEMPT = (1, 0, -1)  # world size, restart count, resumed-from step


def _draws() -> list[Any]:
    return [random.random(), torch.rand(3).tolist(), float(np.random.normal()),
            float(np.random.rand())]


def test_record_round_trip_restores_every_stream(tmp_path: Path) -> None:
    np.random.normal()  # leaves a cached gaussian in numpy's legacy state
    record = rescue.BoundaryRecord(tmp_path, 0, ATTEMPT, lambda: [])
    record.record(4)
    expected = _draws()
    state = rescue.read_record(tmp_path, 0, 4, ATTEMPT)
    assert state is not None
    restore_rng(state)
    assert _draws() == expected


def test_numpy_state_is_read_again_whenever_it_may_have_changed(tmp_path: Path) -> None:
    """The record skips numpy's get_state while the generator's state is unchanged;
    a pending cached gaussian is used up without changing it, so then it may not."""
    record = rescue.BoundaryRecord(tmp_path, 0, ATTEMPT, lambda: [])
    for step, draw in enumerate([None, None, np.random.normal, np.random.normal,
                                 np.random.rand, None], start=1):
        if draw is not None:
            draw()
        record.record(step)
        expected = _draws()
        state = rescue.read_record(tmp_path, 0, step, ATTEMPT)
        assert state is not None
        restore_rng(state)
        assert _draws() == expected, f"step {step}"


def test_two_slots_and_refused_records(tmp_path: Path) -> None:
    record = rescue.BoundaryRecord(tmp_path, 3, ATTEMPT, lambda: [])
    record.record(5)
    record.record(6)
    assert rescue.read_record(tmp_path, 3, 5, ATTEMPT) is not None  # the other slot
    assert rescue.read_record(tmp_path, 3, 6, ATTEMPT) is not None
    record.record(7)  # overwrites step 5's slot
    assert rescue.read_record(tmp_path, 3, 5, ATTEMPT) is None
    assert rescue.read_record(tmp_path, 3, 7, (1, 1, -1)) is None  # another attempt's
    assert rescue.read_record(tmp_path, 2, 7, ATTEMPT) is None  # no such rank here
    raw = bytearray((tmp_path / "rank3").read_bytes())
    raw[rescue.SLOT_BYTES + 100] ^= 0xFF  # torn: step 7's slot (the second) is damaged
    (tmp_path / "rank3").write_bytes(bytes(raw))
    assert rescue.read_record(tmp_path, 3, 7, ATTEMPT) is None
    assert rescue.read_record(tmp_path, 3, 6, ATTEMPT) is not None


def test_version_check_sees_in_place_changes(tmp_path: Path) -> None:
    weight = torch.zeros(4)
    record = rescue.BoundaryRecord(tmp_path, 0, ATTEMPT, lambda: [weight])
    record.record(1)
    assert record.unchanged()
    weight.add_(1.0)
    assert not record.unchanged()
    record.record(2)
    assert record.unchanged()


def test_one_rank_per_node_takes_the_rescue(tmp_path: Path) -> None:
    assert rescue.take_lock(tmp_path, ATTEMPT, 9)
    assert not rescue.take_lock(tmp_path, ATTEMPT, 9)
    assert rescue.take_lock(tmp_path, ATTEMPT, 10)


def _failed_step(parts: Any) -> RuntimeError:
    """What a step that dies in its backward leaves behind: the forward ran (dropout
    and python's RNG advanced), the optimizer did not step."""
    model = parts[0]
    model(torch.randn(4, 6)).sum()
    random.random()
    return RuntimeError("Connection reset by peer")


def _crashed_run(tmp_path: Path, until: int) -> Any:
    parts = build(str(tmp_path / "run"), memory_every=1000, memory_dir=str(tmp_path / "mem"))
    train(*parts, until=until)
    parts[4].wait()  # durable step 5 committed, as the crashed run's would be
    return parts


def _resume(tmp_path: Path) -> tuple[Any, Any]:
    parts = build(str(tmp_path / "run"), memory_every=1000, memory_dir=str(tmp_path / "mem"))
    return parts, parts[4].restore()


def test_rescue_after_a_failed_step_resumes_bit_exact(tmp_path: Path) -> None:
    ref = build(str(tmp_path / "ref"))
    ref_losses = train(*ref, until=12)
    ref[4].close()
    crashed = _crashed_run(tmp_path, 7)  # durable 5; steps 6 and 7 only in this process
    with capture_logs() as logs:
        rescue.on_uncaught(_failed_step(crashed))
    (rescued,) = [e for e in logs if e["event"] == "snapshot.rescued"]
    assert (rescued["snapshot_step"], rescued["tier"]) == (7, "memory")
    assert list_snapshot_dirs(open_store(str(tmp_path / "mem"))) == [7]
    with capture_logs() as logs:
        parts, info = _resume(tmp_path)
    assert (info.from_step, info.tier) == (7, "memory")
    (resume,) = [e for e in logs if e["event"] == "resume"]
    assert (resume["rescued"], resume["memory_kept"]) == (True, True)
    model, opt, sched, sampler, snap = parts
    losses = train(model, opt, sched, sampler, snap, until=12)
    snap.close()
    assert losses == ref_losses[7:]
    for a, b in zip(ref[0].state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_no_rescue_once_the_optimizer_stepped(tmp_path: Path) -> None:
    crashed = _crashed_run(tmp_path, 7)
    model, opt, *_ = crashed
    model(torch.randn(4, 6)).pow(2).mean().backward()
    opt.step()  # the failure comes after the update, before snap.step()
    with capture_logs() as logs:
        rescue.on_uncaught(RuntimeError("Connection reset by peer"))
    (skipped,) = [e for e in logs if e["event"] == "snapshot.rescue_skipped"]
    assert "changed after step 7" in skipped["reason"]
    assert list_snapshot_dirs(open_store(str(tmp_path / "mem"))) == []
    with capture_logs() as logs:
        _, info = _resume(tmp_path)
    assert (info.from_step, info.tier) == (5, "durable")
    assert [e["rescued"] for e in logs if e["event"] == "resume"] == [False]


def test_no_rescue_for_a_job_with_per_rank_state(tmp_path: Path) -> None:
    """The step records hold RNG states only: a job with per-rank state (``rank_extras``
    here, ``state=`` objects alike) resumes from the newest snapshot instead."""
    crashed = _crashed_run(tmp_path, 7)
    crashed[4].rank_extras["shard"] = 3
    with capture_logs() as logs:
        rescue.on_uncaught(_failed_step(crashed))
    (skipped,) = [e for e in logs if e["event"] == "snapshot.rescue_skipped"]
    assert "per-rank state" in skipped["reason"]
    assert list_snapshot_dirs(open_store(str(tmp_path / "mem"))) == []
    _, info = _resume(tmp_path)
    assert (info.from_step, info.tier) == (5, "durable")


def test_torn_record_of_a_rank_falls_back_to_the_periodic_snapshots(tmp_path: Path) -> None:
    crashed = _crashed_run(tmp_path, 7)
    record = tmp_path / "mem" / rescue.BOUNDARY_DIR / "rank0"
    raw = bytearray(record.read_bytes())
    raw[rescue.SLOT_BYTES + 100] ^= 0xFF  # step 7 is in the second slot: killed mid-write
    record.write_bytes(bytes(raw))
    with capture_logs() as logs:
        rescue.on_uncaught(_failed_step(crashed))
    (skipped,) = [e for e in logs if e["event"] == "snapshot.rescue_skipped"]
    assert "rank(s) [0]" in skipped["reason"]
    _, info = _resume(tmp_path)
    assert (info.from_step, info.tier) == (5, "durable")


def test_a_failing_rescue_write_commits_nothing(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    crashed = _crashed_run(tmp_path, 7)
    from elastictrain.storage.fsspec_store import FsspecStore

    real_write = FsspecStore.write_bytes

    def fail_the_commit(self: Any, path: str, data: Any, *args: Any, **kw: Any) -> Any:
        if path.endswith(layout.MANIFEST):  # the data is written, the commit fails
            raise PermissionError(13, "Permission denied", path)
        return real_write(self, path, data, *args, **kw)

    monkeypatch.setattr(FsspecStore, "write_bytes", fail_the_commit)
    with capture_logs() as logs:
        rescue.on_uncaught(_failed_step(crashed))
    monkeypatch.undo()
    assert [e for e in logs if e["event"] == "snapshot.rescue_skipped"]
    assert not [e for e in logs if e["event"] == "snapshot.rescued"]
    _, info = _resume(tmp_path)  # nothing half-written is loaded
    assert (info.from_step, info.tier) == (5, "durable")


def test_shutdown_in_a_finally_rescues_before_any_teardown(tmp_path: Path) -> None:
    """The usual script ends ``finally: et.shutdown()``: the rescue runs there, while
    the error propagates, not after the teardown (the agent may stop us by then)."""
    crashed = _crashed_run(tmp_path, 7)
    with capture_logs() as logs, pytest.raises(RuntimeError):
        try:
            raise _failed_step(crashed)
        finally:
            runtime.shutdown()
    assert [e["snapshot_step"] for e in logs if e["event"] == "snapshot.rescued"] == [7]


def test_an_exit_or_ctrl_c_is_not_rescued(tmp_path: Path) -> None:
    """A preemption exits 75 by SystemExit after its final snapshot: nothing to rescue."""
    _crashed_run(tmp_path, 7)
    with capture_logs() as logs:
        rescue.on_uncaught(SystemExit(75))
        rescue.on_uncaught(KeyboardInterrupt())
    assert not [e for e in logs if e["event"].startswith("snapshot.rescue")]
    assert list_snapshot_dirs(open_store(str(tmp_path / "mem"))) == []


def test_a_memory_save_of_the_failed_step_commits_before_the_process_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rescue is skipped when the step's own memory snapshot was taken; that
    snapshot is still persisting, and the process must not end before it commits."""
    from elastictrain.snapshot.rescuer import Rescuer
    from elastictrain.storage.fsspec_store import FsspecStore

    rescue_began = threading.Event()
    real_marked = Rescuer._rescue_marked

    def marked(self: Any, *args: Any) -> None:
        rescue_began.set()
        real_marked(self, *args)

    real_write = FsspecStore.write_bytes

    def commit_after_the_failure(self: Any, path: str, data: Any, *args: Any,
                                 **kw: Any) -> Any:
        if path.endswith(layout.MANIFEST) and str(tmp_path / "mem") in str(self.root):
            assert rescue_began.wait(timeout=60)  # still in flight when the rescue starts
        return real_write(self, path, data, *args, **kw)

    monkeypatch.setattr(Rescuer, "_rescue_marked", marked)
    monkeypatch.setattr(FsspecStore, "write_bytes", commit_after_the_failure)
    parts = build(str(tmp_path / "run"), memory_every=7, memory_dir=str(tmp_path / "mem"))
    train(*parts, until=7)  # step 7's memory snapshot is taken, its commit held
    with capture_logs() as logs:
        rescue.on_uncaught(_failed_step(parts))
    (skipped,) = [e for e in logs if e["event"] == "snapshot.rescue_skipped"]
    assert "already taken" in skipped["reason"]
    assert list_snapshot_dirs(open_store(str(tmp_path / "mem"))) == [7]


def test_a_memory_save_whose_gather_failed_leaves_the_step_to_the_rescue(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that dies during a memory step's RNG gather: that save wrote nothing, so
    the survivor rescues the step instead of waiting for a snapshot that never comes."""
    parts = build(str(tmp_path / "run"), memory_every=2, memory_dir=str(tmp_path / "mem"))
    train(*parts, until=7)
    snap = parts[4]

    def peer_gone(obj: Any) -> list[Any]:
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(snap.ctx, "all_gather_object", peer_gone)
    with pytest.raises(RuntimeError, match="closed by peer") as failed:
        train(*parts, until=8)
    monkeypatch.undo()
    with capture_logs() as logs:
        rescue.on_uncaught(failed.value)
    assert [e["snapshot_step"] for e in logs if e["event"] == "snapshot.rescued"] == [8], logs
    assert list_snapshot_dirs(open_store(str(tmp_path / "mem"))) == [8]
