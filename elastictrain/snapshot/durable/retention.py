"""Retention: after a commit, delete older snapshots, abandoned partial writes and
snapshot objects no manifest names (orphans).

Orphans are what a crashed or failed attempt left in a step directory that
another attempt committed: a replicated payload, a sharded snapshot's parts,
DCP metadata or training state, or the temporary file of an interrupted local
write of one of those. A step directory without a manifest is deleted whole once
a newer step committed.

Nothing is deleted on the strength of a failed read: a step counts as committed
when its manifest exists (a failed existence check fails the prune), and
orphans are looked for only under a manifest that was read successfully (a
failed listing fails the prune).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from elastictrain.core import layout
from elastictrain.core.errors import StorageError
from elastictrain.core.log import get_logger
from elastictrain.snapshot.format.commitmark import is_committed
from elastictrain.snapshot.format.reader import list_snapshot_dirs, read_manifest
from elastictrain.storage.api import Store

log = get_logger("elastictrain.snapshot")

_TMP_SUFFIX = re.compile(r"\.tmp-[0-9a-f]{32}$")  # the local store's write-then-rename


@dataclass(frozen=True)
class Deletion:
    """One thing retention deletes: a step directory or an object in one."""

    path: str
    step: int | None
    reason: str  # "retention" (older than the kept), "partial" (abandoned), "orphan"


@dataclass(frozen=True)
class Plan:
    """What retention deletes, in order, and the committed steps it keeps."""

    deletions: list[Deletion]
    kept: list[int]  # newest first


def plan(store: Store, keep: int, newest_step: int) -> Plan:
    """What ``prune`` would delete and keep (nothing is deleted here): the newest
    ``keep`` committed snapshots (always ``newest_step``) are kept; older ones,
    abandoned partial writes and orphans in the kept steps go."""
    names = store.list_dir(layout.SNAPSHOTS)
    committed: list[int] = []
    deletions: list[Deletion] = []
    for step in list_snapshot_dirs(store, names):
        if is_committed(store, step):
            committed.append(step)
        elif step < newest_step:
            deletions.append(Deletion(layout.step_dir(step), step, "partial"))
    keep_steps = set(sorted(committed, reverse=True)[:keep]) | {newest_step}
    deletions += [Deletion(layout.step_dir(s), s, "retention") for s in committed
                  if s not in keep_steps and s < newest_step]
    deletions += [Deletion(f"{layout.SNAPSHOTS}/{name}", None, "partial") for name in names
                  if layout.is_partial(name)]
    kept = sorted(keep_steps & set(committed))
    for step in kept:
        deletions += _orphans(store, step)
    return Plan(deletions, kept[::-1])


def prune(store: Store, keep: int, newest_step: int) -> list[int]:
    """Retention, run only after ``newest_step`` committed (``plan``). Returns the
    pruned steps."""
    return carry_out(store, plan(store, keep, newest_step))


def carry_out(store: Store, planned: Plan) -> list[int]:
    """Delete what ``planned`` names, in order; returns the steps pruned by retention."""
    for deletion in planned.deletions:
        _prune_one(store, deletion)
    return [d.step for d in planned.deletions if d.reason == "retention" and d.step is not None]


def _orphans(store: Store, step: int) -> list[Deletion]:
    """Snapshot objects in ``step`` the committed manifest does not name (a writer that
    lost the commit race, or an attempt that crashed or failed before committing this
    step)."""
    try:
        named = {o.name for o in read_manifest(store, step).objects}
    except StorageError:  # corrupt, or unreadable right now: never guess, keep everything
        return []
    return [Deletion(f"{layout.step_dir(step)}/{name}", step, "orphan")
            for name in store.list_dir(layout.step_dir(step))
            if name not in named and _is_object(_TMP_SUFFIX.sub("", name))]


def _is_object(name: str) -> bool:
    return layout.is_payload(name) or layout.is_sharded_object(name)


def _prune_one(store: Store, deletion: Deletion) -> None:
    started = time.perf_counter()
    store.delete(deletion.path, recursive=True)
    log.info("snapshot.pruned", snapshot_step=deletion.step, path=deletion.path,
             reason=deletion.reason, duration_s=round(time.perf_counter() - started, 4))
