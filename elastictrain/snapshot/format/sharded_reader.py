"""Reading and verifying a committed sharded snapshot (written by ``sharded/commit.py``):
its parts are there with their sizes, each object is whole and matches its checksum.
"""

from __future__ import annotations

import re
import time

from elastictrain.core import layout
from elastictrain.core.config import ChecksumAlgorithm
from elastictrain.core.errors import SnapshotCorrupt, StorageNotFoundError
from elastictrain.core.log import get_logger
from elastictrain.snapshot.format.checksum import checksum_bytes, new_hasher
from elastictrain.snapshot.format.manifest import Manifest, ObjectEntry
from elastictrain.storage.api import Store

log = get_logger("elastictrain.snapshot")

_READ_CHUNK = 8 << 20
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # joined to a path: no "/" or ".."


def object_of(manifest: Manifest, prefix: str, where: str) -> ObjectEntry:
    """The one object whose name starts with ``prefix`` (``dcp-`` or ``train-``)."""
    found = [o for o in manifest.objects if o.name.startswith(prefix)]
    if len(found) != 1:
        raise SnapshotCorrupt(f"{where}: manifest names {len(found)} '{prefix}…' objects, "
                              "expected 1")
    return found[0]


def check_parts(store: Store, manifest: Manifest,
                entries: list[ObjectEntry] | None = None) -> None:
    """Every object the manifest names (or ``entries`` of them) exists with its size
    (cheap: no data read, one size request per object).

    Raises:
        SnapshotCorrupt: an object is missing or has another size (a rank's part lost).
        StorageError: the size could not be read (throttled, timed out): no corruption,
            the attempt fails, as in the replicated path (snapshot/format/reader.py).
    """
    directory = layout.step_dir(manifest.step)
    for entry in manifest.objects if entries is None else entries:
        if not _SAFE_NAME.match(entry.name):
            raise SnapshotCorrupt(f"{store.url}/{directory}: manifest names {entry.name!r}")
        path = f"{directory}/{entry.name}"
        try:
            size = store.size(path)
        except StorageNotFoundError as exc:  # only a missing object is corruption
            raise SnapshotCorrupt(f"{store.url}/{path}: part of rank {entry.rank} is "
                                  f"missing: {exc}") from exc
        if size != entry.size_bytes:
            raise SnapshotCorrupt(f"{store.url}/{path}: {size} bytes, manifest says "
                                  f"{entry.size_bytes} (truncated?)")


def read_object(store: Store, manifest: Manifest, entry: ObjectEntry) -> bytes:
    """A small object (metadata, training state), read whole and verified; a read
    error other than a missing object is raised as it is (no corruption)."""
    path = f"{layout.step_dir(manifest.step)}/{entry.name}"
    try:
        data = store.read_bytes(path)
    except StorageNotFoundError as exc:
        raise SnapshotCorrupt(f"{store.url}/{path}: missing: {exc}") from exc
    actual = checksum_bytes(data, manifest.checksum_algorithm)
    if len(data) != entry.size_bytes or actual != entry.checksum:
        raise SnapshotCorrupt(f"{store.url}/{path}: {len(data)} bytes, "
                              f"{manifest.checksum_algorithm} {actual}; manifest says "
                              f"{entry.size_bytes} bytes, {entry.checksum}")
    return data


def verify_sharded(store: Store, manifest: Manifest) -> Manifest:
    """Read every object of a sharded snapshot in chunks and check size and checksum.

    Raises:
        SnapshotCorrupt: a part is missing, truncated or fails its checksum.
        StorageError: a read failed otherwise (raised, never reported as corruption).
    """
    started = time.perf_counter()
    check_parts(store, manifest)
    directory = layout.step_dir(manifest.step)
    for entry in manifest.objects:
        path = f"{directory}/{entry.name}"
        actual = _checksum_object(store, path, manifest.checksum_algorithm)
        if actual != entry.checksum:
            raise SnapshotCorrupt(f"{store.url}/{path} (rank {entry.rank}): "
                                  f"{manifest.checksum_algorithm} {actual} != manifest "
                                  f"{entry.checksum}")
    log.debug("snapshot.verified", snapshot_step=manifest.step, size_bytes=manifest.total_bytes,
              duration_s=round(time.perf_counter() - started, 4))
    return manifest


def _checksum_object(store: Store, path: str, algorithm: ChecksumAlgorithm) -> str:
    hasher = new_hasher(algorithm)
    try:
        with store.open_read(path) as source:
            while chunk := source.read(_READ_CHUNK):
                hasher.update(chunk)
    except StorageNotFoundError as exc:
        raise SnapshotCorrupt(f"{store.url}/{path}: missing: {exc}") from exc
    return hasher.hexdigest()


def parts_by_rank(manifest: Manifest) -> list[dict[str, int | None]]:
    """Per writing rank: how many objects and bytes (``snapshots inspect``)."""
    ranks: dict[int | None, dict[str, int | None]] = {}
    for entry in manifest.objects:
        row = ranks.setdefault(entry.rank, {"rank": entry.rank, "objects": 0, "items": 0,
                                            "size_bytes": 0})
        row["objects"] = int(row["objects"] or 0) + 1
        row["items"] = int(row["items"] or 0) + len(entry.items or [])
        row["size_bytes"] = int(row["size_bytes"] or 0) + entry.size_bytes
    return [ranks[r] for r in sorted(ranks, key=lambda r: -1 if r is None else r)]
