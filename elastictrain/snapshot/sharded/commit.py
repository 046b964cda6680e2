"""The commit of a sharded snapshot (reading and verifying one: ``format/sharded_reader.py``).

Every rank writes ``rank<R>-<token>.distcp``; after DCP has gathered every
rank's write results, the coordinator (rank 0) writes ``dcp-<token>.metadata``
(DCP's global plan), ``train-<token>.pt`` (the replicated training state:
step, sampler, RNG, scheduler, extras) and then ``MANIFEST.json``, created only
if absent: the commit. Object names carry a token unique per writer and
attempt, so a crashed attempt's leftovers never mix with a committed snapshot;
objects no manifest names are never loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastictrain.core import layout
from elastictrain.core.log import get_logger
from elastictrain.snapshot.durable.commit import build_manifest, committed_objects, drop_replaced
from elastictrain.snapshot.format.checksum import checksum_bytes
from elastictrain.snapshot.format.commitmark import commit_in_place
from elastictrain.snapshot.format.manifest import (
    SHARDED_FORMAT_VERSION,
    ItemEntry,
    Manifest,
    ObjectEntry,
    SnapshotMeta,
)
from elastictrain.storage.api import Store

if TYPE_CHECKING:  # DCP imports torch: the CLI lists and prunes snapshots without it
    from elastictrain.snapshot.sharded.dcp_io import RankPart

log = get_logger("elastictrain.snapshot")

def metadata_name(token: str) -> str:
    return f"dcp-{token}.metadata"


def train_name(token: str) -> str:
    return f"train-{token}.pt"


def commit_sharded(store: Store, meta: SnapshotMeta, token: str, parts: list[RankPart],
                   metadata_bytes: bytes, train_bytes: bytes) -> Manifest | None:
    """(rank 0, after every part is durable) write the metadata, the training state and
    the manifest last. Returns the manifest, or None if another writer committed first."""
    directory = layout.step_dir(meta.step)
    manifest = sharded_manifest(meta, token, parts, metadata_bytes, train_bytes)
    # A second save of a step this process saved (``meta.replaces``) overwrites the
    # marker in one write; the old copy's objects carry another token.
    old = committed_objects(store, meta.step) if meta.replaces else None
    for name, data in ((metadata_name(token), metadata_bytes), (train_name(token), train_bytes)):
        store.write_bytes(f"{directory}/{name}", data)
    if not commit_in_place(store, meta.step, manifest.to_json(), exclusive=not meta.replaces):
        log.info("snapshot.exists", snapshot_step=meta.step, action="kept",
                 reason="another writer committed this step first")
        return None
    if old is not None:
        drop_replaced(store, meta.step, old, manifest)
    return manifest


def sharded_manifest(meta: SnapshotMeta, token: str, parts: list[RankPart],
                     metadata_bytes: bytes, train_bytes: bytes) -> Manifest:
    """The manifest of a sharded snapshot: every rank's part, then the DCP metadata and
    the training state (both written by rank 0)."""
    algorithm = meta.checksum_algorithm
    objects = [_part_entry(part) for part in sorted(parts, key=lambda p: p.rank)]
    for name, data in ((metadata_name(token), metadata_bytes), (train_name(token), train_bytes)):
        objects.append(ObjectEntry(name=name, size_bytes=len(data), rank=0,
                                   checksum=checksum_bytes(data, algorithm)))
    return build_manifest(meta, objects, SHARDED_FORMAT_VERSION)


def _part_entry(part: RankPart) -> ObjectEntry:
    return ObjectEntry(
        name=part.object_name, size_bytes=part.size_bytes, checksum=part.checksum,
        rank=part.rank,
        items=[ItemEntry(offset=i.offset, length=i.length, checksum=i.checksum)
               for i in part.items])
