"""The commit of a sharded snapshot and its verification.

Every rank writes ``rank<R>-<token>.distcp``; after DCP has gathered every
rank's write results, the coordinator (rank 0) writes ``dcp-<token>.metadata``
(DCP's global plan), ``train-<token>.pt`` (the replicated training state:
step, sampler, RNG, scheduler, extras) and then ``MANIFEST.json``, created only
if absent: the commit. Object names carry a token unique per writer and
attempt, so a crashed attempt's leftovers never mix with a committed snapshot;
objects no manifest names are never loaded.
"""

from __future__ import annotations

import re
import time

from elastictrain.config import ChecksumAlgorithm
from elastictrain.errors import SnapshotCorrupt, StorageConflictError, StorageNotFoundError
from elastictrain.log import get_logger
from elastictrain.snapshot import layout
from elastictrain.snapshot.checksum import checksum_bytes, new_hasher
from elastictrain.snapshot.commit import SnapshotMeta, build_manifest
from elastictrain.snapshot.manifest import (
    SHARDED_FORMAT_VERSION,
    ItemEntry,
    Manifest,
    ObjectEntry,
)
from elastictrain.snapshot.sharded.dcp_io import RankPart
from elastictrain.storage.api import Store

log = get_logger("elastictrain.snapshot")

_READ_CHUNK = 8 << 20
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # joined to a path: no "/" or ".."
# The names this module and dcp_io.StoreWriter give a snapshot's objects.
_OBJECT_NAME = re.compile(
    r"^(rank\d{5}-[0-9a-f]{1,32}\.distcp|dcp-[0-9a-f]{1,32}\.metadata|train-[0-9a-f]{1,32}\.pt)$")


def metadata_name(token: str) -> str:
    return f"dcp-{token}.metadata"


def train_name(token: str) -> str:
    return f"train-{token}.pt"


def is_sharded_object(name: str) -> bool:
    """Whether ``name`` is a sharded snapshot's object: a rank's part, the DCP metadata or
    the training state (retention deletes those no committed manifest names)."""
    return _OBJECT_NAME.match(name) is not None


def commit_sharded(store: Store, meta: SnapshotMeta, token: str, parts: list[RankPart],
                   metadata_bytes: bytes, train_bytes: bytes) -> Manifest | None:
    """(rank 0, after every part is durable) write the metadata, the training state and
    the manifest last. Returns the manifest, or None if another writer committed first."""
    directory = layout.step_dir(meta.step)
    algorithm = meta.checksum_algorithm
    objects = [_part_entry(part) for part in sorted(parts, key=lambda p: p.rank)]
    for name, data in ((metadata_name(token), metadata_bytes), (train_name(token), train_bytes)):
        store.write_bytes(f"{directory}/{name}", data)
        objects.append(ObjectEntry(name=name, size_bytes=len(data), rank=0,
                                   checksum=checksum_bytes(data, algorithm)))
    manifest = build_manifest(meta, objects, SHARDED_FORMAT_VERSION)
    try:
        store.write_bytes(f"{directory}/{layout.MANIFEST}", manifest.to_json(), if_absent=True)
    except StorageConflictError:
        log.info("snapshot.exists", snapshot_step=meta.step, action="kept",
                 reason="another writer committed this step first")
        return None
    return manifest


def _part_entry(part: RankPart) -> ObjectEntry:
    return ObjectEntry(
        name=part.object_name, size_bytes=part.size_bytes, checksum=part.checksum,
        rank=part.rank,
        items=[ItemEntry(offset=i.offset, length=i.length, checksum=i.checksum)
               for i in part.items])


def object_of(manifest: Manifest, prefix: str, where: str) -> ObjectEntry:
    """The one object whose name starts with ``prefix`` (``dcp-`` or ``train-``)."""
    found = [o for o in manifest.objects if o.name.startswith(prefix)]
    if len(found) != 1:
        raise SnapshotCorrupt(f"{where}: manifest names {len(found)} '{prefix}…' objects, "
                              "expected 1")
    return found[0]


def check_parts(store: Store, manifest: Manifest) -> None:
    """Every object the manifest names exists with its size (cheap: no data read).

    Raises:
        SnapshotCorrupt: an object is missing or has another size (a rank's part lost).
        StorageError: the size could not be read (throttled, timed out): no corruption,
            the attempt fails, as in the replicated path (reader.py).
    """
    directory = layout.step_dir(manifest.step)
    for entry in manifest.objects:
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
