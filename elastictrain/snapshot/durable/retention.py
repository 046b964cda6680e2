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

from elastictrain.core import layout
from elastictrain.core.errors import StorageError
from elastictrain.core.log import get_logger
from elastictrain.snapshot.format.commitmark import is_committed
from elastictrain.snapshot.format.reader import list_snapshot_dirs, read_manifest
from elastictrain.storage.api import Store

log = get_logger("elastictrain.snapshot")

_TMP_SUFFIX = re.compile(r"\.tmp-[0-9a-f]{32}$")  # the local store's write-then-rename


def prune(store: Store, keep: int, newest_step: int) -> list[int]:
    """Retention, run only after ``newest_step`` committed: keep the newest ``keep``
    committed snapshots (always ``newest_step``), delete older ones and abandoned
    partial writes. Returns the pruned steps."""
    names = store.list_dir(layout.SNAPSHOTS)
    committed: list[int] = []
    for step in list_snapshot_dirs(store, names):
        if is_committed(store, step):
            committed.append(step)
        elif step < newest_step:
            _prune_one(store, layout.step_dir(step), step, "partial")
    keep_steps = set(sorted(committed, reverse=True)[:keep]) | {newest_step}
    pruned = [s for s in committed if s not in keep_steps and s < newest_step]
    for step in pruned:
        _prune_one(store, layout.step_dir(step), step, "retention")
    for name in names:
        if layout.is_partial(name):
            _prune_one(store, f"{layout.SNAPSHOTS}/{name}", None, "partial")
    for step in sorted(keep_steps & set(committed)):
        _prune_orphans(store, step)
    return pruned


def _prune_orphans(store: Store, step: int) -> None:
    """Delete snapshot objects the committed manifest does not name (a writer that
    lost the commit race, or an attempt that crashed or failed before committing
    this step)."""
    try:
        named = {o.name for o in read_manifest(store, step).objects}
    except StorageError:  # corrupt, or unreadable right now: never guess, keep everything
        return
    for name in store.list_dir(layout.step_dir(step)):
        if name not in named and _is_object(_TMP_SUFFIX.sub("", name)):
            _prune_one(store, f"{layout.step_dir(step)}/{name}", step, "orphan")


def _is_object(name: str) -> bool:
    return layout.is_payload(name) or layout.is_sharded_object(name)


def _prune_one(store: Store, path: str, step: int | None, reason: str) -> None:
    started = time.perf_counter()
    store.delete(path, recursive=True)
    log.info("snapshot.pruned", snapshot_step=step, path=path, reason=reason,
             duration_s=round(time.perf_counter() - started, 4))
