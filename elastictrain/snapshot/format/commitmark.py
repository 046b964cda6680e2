"""The commit marker: the one module that writes ``MANIFEST.json`` or asks whether it is
there, for every tier (durable and node memory, replicated and sharded, a copy received
from a peer).

A snapshot of step N is committed once ``snapshots/step_N/MANIFEST.json`` exists; the
marker is always written after every object it names. Two ways to write it:

* **in place** (object stores, and node-memory directories a node's leader completes):
  the marker is the last object written into ``step_N``; ``exclusive`` creates it only if
  absent where the store enforces that, so of two writers racing for one step exactly
  one wins;
* **by rename** (a store that renames, e.g. a local or NFS file system): the marker is
  written into a private ``.partial-…`` directory, which is then renamed to ``step_N``;
  a crash leaves only a partial directory, which discovery ignores.

A committed snapshot set aside (durable/suspects.py) leaves ``snapshots/`` through
:func:`move_committed`: in one rename, or copied with the marker last and deleted with the
marker first, so that no half-moved directory is ever a committed snapshot.

Whether a committed snapshot also *verifies* (its checksums, its signature) is for
``reader.verify_snapshot``; this module only knows the marker.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable

from elastictrain.core import layout
from elastictrain.core.errors import StorageConflictError, StorageNotFoundError
from elastictrain.storage.api import Store


def marker_path(directory: str) -> str:
    """The marker's path inside a snapshot's (or a partial) directory."""
    return f"{directory}/{layout.MANIFEST}"


def read_marker(store: Store, step: int) -> bytes:
    """The committed manifest of ``step``, as stored.

    Raises:
        StorageNotFoundError: ``step`` is not committed.
        StorageError: the read failed (which says nothing about the snapshot).
    """
    return store.read_bytes(marker_path(layout.step_dir(step)))


def is_committed(store: Store, step: int) -> bool:
    """Whether ``step`` has its marker. On a file system one stat; on an object store one
    GET, not ``exists``: a missing object is one 404 there, where s3fs follows a 404 HEAD
    with a listing (a "directory" check). A check that fails for another reason raises:
    it says nothing about the snapshot."""
    path = marker_path(layout.step_dir(step))
    if store.local_path(path) is not None:
        return store.exists(path)
    try:
        store.read_bytes(path)
    except StorageNotFoundError:
        return False
    return True


def commit_in_place(store: Store, step: int, manifest_json: bytes, *,
                    exclusive: bool) -> bool:
    """Write the marker of ``step`` into ``step_N``, after all it names. ``exclusive``:
    create it only if absent; False when another writer committed first (the caller
    decides whether theirs is acceptable). Non-exclusive overwrites: a node completing
    its own memory copy."""
    try:
        store.write_bytes(marker_path(layout.step_dir(step)), manifest_json,
                          if_absent=exclusive)
    except StorageConflictError:
        return False
    return True


def commit_by_rename(store: Store, partial: str, step: int, manifest_json: bytes, *,
                     replace: bool, before_commit: Callable[[], None] | None = None) -> bool:
    """Write the marker into ``partial`` (every object it names already there), then
    rename ``partial`` to ``step_N``. An uncommitted leftover at ``step_N`` (an earlier
    crash) is removed first. A committed ``step_N`` is kept (False returned, ``partial``
    left to the caller) unless ``replace``: a copy the ranks agreed on supersedes a copy
    of the same step that the restore agreement set aside. ``before_commit`` runs after
    the marker is written and before the rename (a last check that may raise)."""
    final = layout.step_dir(step)
    store.write_bytes(marker_path(partial), manifest_json)
    if before_commit is not None:
        before_commit()
    if not replace and store.exists(marker_path(final)):  # committed since we checked
        return False
    if store.exists(final):
        store.delete(final, recursive=True)
    store.rename(partial, final)
    return True


def move_committed(store: Store, step: int, target: str) -> None:
    """Move the committed snapshot of ``step`` to ``target`` (outside ``snapshots/``)."""
    source = layout.step_dir(step)
    if store.supports_rename:
        store.rename(source, target)
        return
    marker = marker_path(source)
    names = sorted(store.list_dir(source), key=lambda name: name == layout.MANIFEST)
    for name in names:  # the marker last: a copy that stops half-way holds none
        with store.open_read(f"{source}/{name}") as src, \
                store.open_write(f"{target}/{name}") as dst:
            shutil.copyfileobj(src, dst, _COPY_CHUNK)
    store.delete(marker)  # no longer a committed snapshot, before any object goes
    store.delete(source, recursive=True)


_COPY_CHUNK = 16 << 20
