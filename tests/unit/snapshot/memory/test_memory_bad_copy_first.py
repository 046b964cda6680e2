"""A bad memory copy before the first durable snapshot (issue 24, case 4).

Memory snapshots every step, the first durable one due at step 5: a crash at step 3
leaves only memory. A byte flipped inside a saved parameter fails the checksum only
after the bytes were read; read into the model's own tensors that left no way to
start (exit 78 on every relaunch). The copy is verified before anything is applied
now: the run starts fresh, and the bad copy is set aside with an event.
"""

from __future__ import annotations

from pathlib import Path

import torch
from structlog.testing import capture_logs

from elastictrain.core import layout
from elastictrain.snapshot.format.reader import list_snapshot_dirs
from elastictrain.storage import open_store
from tests.small_job import build, train
from tests.unit.snapshot.test_restore_in_place import flip_a_parameter_byte


def test_a_corrupt_memory_copy_with_no_durable_snapshot_means_a_fresh_start(
        tmp_path: Path) -> None:
    run, mem = str(tmp_path / "run"), str(tmp_path / "mem")
    crashed = build(run, memory_every=1, memory_dir=mem)
    train(*crashed, until=3)
    crashed[4].wait()  # a crash: no close(), memory kept
    assert list_snapshot_dirs(open_store(run)) == []
    assert list_snapshot_dirs(open_store(mem))[0] == 3
    flip_a_parameter_byte(tmp_path / "mem" / layout.step_dir(3) / layout.PAYLOAD)

    for attempt in range(2):  # the relaunch after it must not meet the bad copy either
        parts = build(run, memory_every=1, memory_dir=mem)
        fresh = [p.detach().clone() for p in parts[0].parameters()]
        with capture_logs() as logs:
            info = parts[4].restore()  # raised RestoreOverwrote (exit 78) before
        assert info.from_step is None, attempt
        assert all(torch.equal(p, f) for p, f in zip(parts[0].parameters(), fresh,
                                                     strict=True))
        events = {e["event"]: e for e in logs}
        if attempt == 0:
            assert events["snapshot.memory_skipped"]["reason"] == "corrupt on some rank"
            aside = events["snapshot.memory_set_aside"]
            assert (aside["snapshot_step"], aside["status"]) == (3, "corrupt")
        else:
            assert "snapshot.memory_set_aside" not in events
        assert list_snapshot_dirs(open_store(mem)) == []
        parts[4].close()


def test_a_good_memory_copy_with_no_durable_snapshot_is_restored(tmp_path: Path) -> None:
    """Read into fresh memory instead of the model's tensors: the same values."""
    run, mem = str(tmp_path / "run"), str(tmp_path / "mem")
    crashed = build(run, memory_every=1, memory_dir=mem)
    train(*crashed, until=3)
    crashed[4].wait()
    parts = build(run, memory_every=1, memory_dir=mem)
    info = parts[4].restore()
    assert (info.from_step, info.tier) == (3, "memory")
    assert all(torch.equal(a, b) for a, b in zip(parts[0].parameters(),
                                                 crashed[0].parameters(), strict=True))
    parts[4].close()
