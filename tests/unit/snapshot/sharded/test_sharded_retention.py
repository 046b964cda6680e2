"""Retention of sharded snapshots on real files: what a crashed or failed attempt left
in a step directory that another attempt committed (parts, DCP metadata, training
state, an interrupted local write) is pruned, by ``elastictrain snapshots prune`` and
after the next commit; nothing a committed manifest names is, and a failed read or
listing deletes nothing."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest

from elastictrain.core import layout
from elastictrain.core.errors import StorageError, StorageTransientError
from elastictrain.snapshot.format.reader import read_manifest
from elastictrain.storage import Store, open_store
from elastictrain.view import ops
from tests.fault_stores import _Wrapper
from tests.small_job import build, train

CRASHED = "0badc0ffee00"  # the token of an attempt that never committed
INTERRUPTED = "rank00001-" + CRASHED + ".distcp.tmp-" + "ab" * 16


def _saved_run(root: Path, until: int) -> None:
    model, opt, sched, sampler, snap = build(str(root), sharded=True)  # every 5, keep 2
    train(model, opt, sched, sampler, snap, until)
    snap.close()


def _plant_leftovers(root: Path, step: int) -> set[str]:
    """A failed attempt's objects in the committed step directory, copied from the
    committed ones under another token, and a file that is not a snapshot object."""
    directory = root / layout.step_dir(step)
    leftovers = {INTERRUPTED}
    for entry in read_manifest(open_store(str(root)), step).objects:
        token = entry.name.split("-", 1)[1].split(".")[0]
        name = entry.name.replace(token, CRASHED)
        shutil.copyfile(directory / entry.name, directory / name)
        leftovers.add(name)
    (directory / INTERRUPTED).write_bytes(b"half a part")
    (directory / "notes.txt").write_text("not a snapshot object: never deleted")
    return leftovers


def _partial_step(root: Path, step: int) -> Path:
    """A step directory whose attempt crashed before the commit (parts, no manifest)."""
    directory = root / layout.step_dir(step)
    directory.mkdir()
    (directory / f"rank00000-{CRASHED}.distcp").write_bytes(b"\0" * 64)
    return directory


def _committed_names(root: Path, step: int) -> set[str]:
    names = {o.name for o in read_manifest(open_store(str(root)), step).objects}
    return names | {layout.MANIFEST}


def test_snapshots_prune_deletes_a_failed_attempts_parts_and_keeps_the_committed(
        tmp_path: Path) -> None:
    root = tmp_path / "run"
    _saved_run(root, until=10)
    leftovers = _plant_leftovers(root, 10)
    older, newer = _partial_step(root, 7), _partial_step(root, 12)
    committed = _committed_names(root, 10)
    assert leftovers <= {p.name for p in (root / layout.step_dir(10)).iterdir()}

    ops.prune_snapshots(open_store(str(root)), keep=2)

    assert {p.name for p in (root / layout.step_dir(10)).iterdir()} == committed | {"notes.txt"}
    assert not older.exists()  # no manifest, older than the newest committed step
    assert newer.exists()  # no manifest, but newer: may be a save in flight
    store = open_store(str(root))
    statuses = {r["step"]: r["status"] for r in ops.verify_snapshots(store)}
    assert (statuses[10], statuses[5]) == ("ok", "ok")
    *_, snap = build(str(root), sharded=True)
    assert snap.restore().from_step == 10


def test_the_next_commit_prunes_leftovers_in_the_steps_it_keeps(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _saved_run(root, until=10)
    _plant_leftovers(root, 10)
    committed = _committed_names(root, 10)
    model, opt, sched, sampler, snap = build(str(root), sharded=True)
    assert snap.restore().from_step == 10
    train(model, opt, sched, sampler, snap, until=15)  # commits 15; keeps 15 and 10
    snap.close()
    assert {p.name for p in (root / layout.step_dir(10)).iterdir()} == committed | {"notes.txt"}


class _FailingRead(_Wrapper):
    """``list_dir`` of ``listing`` or the read of ``manifest_of``'s manifest fails, as a
    store does once its own retries are used up."""

    def __init__(self, inner: Store, listing: str | None = None,
                 manifest_of: int | None = None) -> None:
        super().__init__(inner)
        self.listing, self.manifest_of = listing, manifest_of

    def list_dir(self, path: str) -> list[str]:
        if path == self.listing:
            raise StorageTransientError(f"list {path}: injected failure")
        return list(self.inner.list_dir(path))

    def read_bytes(self, path: str) -> bytes:
        if self.manifest_of is not None and \
                path == f"{layout.step_dir(self.manifest_of)}/{layout.MANIFEST}":
            raise StorageTransientError(f"read {path}: injected failure")
        return bytes(self.inner.read_bytes(path))


@pytest.mark.parametrize("failing", [{"listing": layout.SNAPSHOTS},
                                     {"listing": layout.step_dir(10)},
                                     {"manifest_of": 10}],
                         ids=["list-snapshots", "list-step", "read-manifest"])
def test_a_failed_read_deletes_no_leftover(tmp_path: Path, failing: dict[str, object]) -> None:
    root = tmp_path / "run"
    _saved_run(root, until=10)
    leftovers = _plant_leftovers(root, 10)
    store = _FailingRead(open_store(str(root)), **failing)  # type: ignore[arg-type]
    with contextlib.suppress(StorageError):  # a failed listing fails the prune
        ops.prune_snapshots(store, keep=2)  # type: ignore[arg-type]
    left = {p.name for p in (root / layout.step_dir(10)).iterdir()}
    assert leftovers | _committed_names(root, 10) <= left
    assert (root / layout.step_dir(5) / layout.MANIFEST).exists()
