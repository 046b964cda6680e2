"""Persisting a staged snapshot: serialise, checksum, write, commit.

Call order and roles: (all ranks) stage → (rank 0) ``persist_snapshot`` →
commit → ``retention.prune``. The commit is one object written last:

* local file systems: everything is written into a unique
  ``snapshots/.partial-…`` directory, fsynced, and the directory is renamed
  to ``snapshots/step_…``; a crash leaves only a partial directory, which
  discovery ignores and retention removes;
* object stores (no rename): the payload is streamed to ``step_…/state-<token>.pt``
  (unique per writer) first and ``MANIFEST.json`` last in one PUT, created only
  if absent where the store enforces it. Two writers racing for one step each
  upload their own payload; exactly one manifest wins and names its payload,
  the loser deletes its own. Objects no manifest names are never loaded, and
  retention removes them.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import sys
import uuid
from collections.abc import Callable
from typing import Any

from elastictrain.core import layout
from elastictrain.core.config import ChecksumAlgorithm
from elastictrain.core.errors import (
    SnapshotCorrupt,
    StorageError,
)
from elastictrain.core.log import get_logger
from elastictrain.snapshot.durable.pacing import Pace, PacedWriter
from elastictrain.snapshot.format import signing
from elastictrain.snapshot.format.checksum import HashingWriter
from elastictrain.snapshot.format.commitmark import commit_by_rename, commit_in_place, is_committed
from elastictrain.snapshot.format.manifest import (
    FORMAT_VERSION,
    Manifest,
    ObjectEntry,
    SnapshotMeta,
)
from elastictrain.snapshot.format.reader import read_manifest, verify_snapshot
from elastictrain.storage.api import Store
from elastictrain.version import __version__

log = get_logger("elastictrain.snapshot")




def serialize_payload(payload: Any, sink: Any, algorithm: ChecksumAlgorithm,
                      pace: Pace | None = None) -> tuple[int, str]:
    """``torch.save`` into ``sink`` while hashing; returns (bytes, checksum).

    torch's own zip CRC32 is switched off: it cost several times the write
    itself (docs/storage.md), and our checksum already covers every byte. On
    a local file the disk starts writing back while later bytes are still
    being hashed and copied (``EarlyWriteback``), instead of idling until the
    final fsync. A sink that can keep references (an S3 upload) is told where the
    payload's tensors live, and sends their bytes from there instead of copying
    them: the payload must not change until the sink is closed (a staged payload
    belongs to the persister until its save is done). ``pace`` holds the whole
    pipeline (checksum, copy, write) to its rate (snapshot/durable/pacing.py).
    """
    # torch is imported where it is used: the CLI lists and prunes snapshots without it.
    import torch
    from torch.utils.serialization import config as serialization_config

    keep = getattr(sink, "keep_references_to", None)
    if keep is not None:
        keep(_cpu_storages(payload))
    writer = HashingWriter(PacedWriter.wrap(EarlyWriteback.wrap(sink), pace),
                           algorithm)
    with serialization_config.patch({"save.compute_crc32": False}):  # type: ignore[attr-defined]
        torch.save(payload, writer)  # type: ignore[arg-type]
    writer.flush()
    return writer.bytes_written, writer.hexdigest()


def _cpu_storages(payload: Any) -> list[Any]:
    """The payload's CPU tensor storages, as byte arrays sharing their memory."""
    from elastictrain.snapshot.format.views import StorageIndex, as_bytes, to_views

    index = StorageIndex()
    to_views(payload, index)
    return [as_bytes(storage).numpy() for storage in index.storages
            if storage.device.type == "cpu"]


class EarlyWriteback:
    """Forwards writes to a local file and asks the kernel to start writing each
    ``every_bytes`` back right away (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``,
    which does not wait). Without it the disk idles until the closing fsync,
    and checksumming plus copying and the disk write add up instead of overlapping."""

    _SYNC_FILE_RANGE_WRITE = 2
    _libc: Any = None

    def __init__(self, sink: Any, fd: int, every_bytes: int) -> None:
        self._sink, self._fd, self._every = sink, fd, every_bytes
        self._written = self._hinted = 0

    @classmethod
    def wrap(cls, sink: Any, every_bytes: int = 64 << 20) -> Any:
        """``sink`` itself where the hint is unavailable (not a local file, not Linux)."""
        if not sys.platform.startswith("linux") or not hasattr(sink, "fileno"):
            return sink
        try:
            fd = sink.fileno()
        except (OSError, ValueError, io.UnsupportedOperation):
            return sink
        if cls._libc is None:
            cls._libc = ctypes.CDLL(None, use_errno=True)
        return cls(sink, fd, every_bytes)

    def write(self, data: Any) -> int:
        n = self._sink.write(data)
        self._written += n
        if self._written - self._hinted >= self._every:
            self._sink.flush()
            self._libc.sync_file_range(self._fd, ctypes.c_int64(self._hinted),
                                       ctypes.c_int64(self._written - self._hinted),
                                       self._SYNC_FILE_RANGE_WRITE)
            self._hinted = self._written
        return int(n)

    def flush(self) -> None:
        self._sink.flush()


def persist_snapshot(store: Store, payload: Any, meta: SnapshotMeta,
                     before_commit: Callable[[], None] | None = None,
                     pace: Pace | None = None) -> Manifest | None:
    """Write and commit one snapshot. Returns its manifest, or None if the same step
    was already committed (by an earlier attempt or another writer) and verifies.

    A committed step is replaced only when it verifiably does not match its
    manifest; a read that fails raises (the persister retries the attempt), so
    nothing committed is ever deleted because a read failed.

    ``before_commit`` runs after the payload is durable and before the commit
    marker: raising there leaves an uncommitted (ignored, later pruned) write.
    ``pace`` paces the payload's write (``serialize_payload``)."""
    final = layout.step_dir(meta.step)
    check = before_commit or _no_check
    if is_committed(store, meta.step):
        if meta.replaces:
            return _replace_committed(store, payload, meta, final, check, pace)
        if _committed_copy_verifies(store, meta.step):
            log.info("snapshot.exists", snapshot_step=meta.step, action="kept")
            return None
        store.delete(final, recursive=True)
    if store.supports_rename:
        return _persist_by_rename(store, payload, meta, check, pace)
    return _persist_manifest_last(store, payload, meta, final, check, pace)


def _replace_committed(store: Store, payload: Any, meta: SnapshotMeta, final: str,
                       before_commit: Callable[[], None], pace: Pace | None) -> Manifest:
    """A second save of a step this process saved already (``meta.replaces``): the new
    payload goes beside the committed one under a name of its own and the marker is
    overwritten in one atomic write, so the step is committed at every moment, to the
    old copy or to the new one. The old copy's objects are deleted after."""
    old = committed_objects(store, meta.step)
    name = layout.payload_name(uuid.uuid4().hex[:12])
    with store.open_write(f"{final}/{name}") as sink:
        size, checksum = serialize_payload(payload, sink, meta.checksum_algorithm, pace)
    manifest = _manifest(meta, size, checksum, name)
    before_commit()
    commit_in_place(store, meta.step, manifest.to_json(), exclusive=False)
    drop_replaced(store, meta.step, old, manifest)
    return manifest


def committed_objects(store: Store, step: int) -> list[str] | None:
    """The object names ``step``'s committed manifest lists, or None when it cannot be
    read (its objects are then left where they are: nothing is deleted on a failed
    read)."""
    try:
        return [entry.name for entry in read_manifest(store, step).objects]
    except (SnapshotCorrupt, StorageError):
        return None


def drop_replaced(store: Store, step: int, old: list[str] | None, new: Manifest) -> None:
    """After ``new`` replaced ``step``'s manifest: delete the objects only the old one
    named (best effort: objects no manifest names are never loaded)."""
    kept = {entry.name for entry in new.objects}
    gone = [name for name in old or [] if name not in kept]
    for name in gone:
        _best_effort_delete(store, f"{layout.step_dir(step)}/{name}")
    log.info("snapshot.replaced", snapshot_step=step, objects_removed=len(gone),
             reason="saved again at this step (state changed after the first save)")


def _committed_copy_verifies(store: Store, step: int) -> bool:
    """True when the committed ``step`` verifies, False on a verified mismatch.

    Raises:
        StorageError: the check could not read the snapshot (throttled, timed out,
            denied): that says nothing about the snapshot, so it is kept.
    """
    try:
        verify_snapshot(store, step)
    except SnapshotCorrupt as exc:
        log.warning("snapshot.corrupt", snapshot_step=step, reason=str(exc),
                    action="replaced")
        return False
    return True


def _no_check() -> None:
    return None


def build_manifest(meta: SnapshotMeta, objects: list[ObjectEntry],
                   format_version: int = FORMAT_VERSION) -> Manifest:
    """The manifest of ``meta``'s snapshot naming ``objects``, signed when a signing key
    is set (every format: replicated and sharded)."""
    import torch

    return signing.sign(Manifest(
        format_version=format_version,
        run_id=meta.run_id,
        step=meta.step,
        epoch=meta.epoch,
        world_size=meta.world_size,
        torch_version=torch.__version__,
        elastictrain_version=__version__,
        checksum_algorithm=meta.checksum_algorithm,
        objects=objects,
        dataset_len=meta.dataset_len,
        global_batch_size=meta.global_batch_size,
        attempt=meta.attempt,
        loss=meta.loss,
    ))


def _manifest(meta: SnapshotMeta, size: int, checksum: str,
              name: str = layout.PAYLOAD) -> Manifest:
    return build_manifest(meta, [ObjectEntry(name=name, size_bytes=size, checksum=checksum)])


def _persist_by_rename(store: Store, payload: Any, meta: SnapshotMeta,
                       before_commit: Callable[[], None],
                       pace: Pace | None) -> Manifest | None:
    partial = layout.partial_dir(meta.step, uuid.uuid4().hex[:12])
    try:
        with store.open_write(f"{partial}/{layout.PAYLOAD}") as sink:
            size, checksum = serialize_payload(payload, sink, meta.checksum_algorithm,
                                               pace)
        manifest = _manifest(meta, size, checksum)
        if not commit_by_rename(store, partial, meta.step, manifest.to_json(), replace=False,
                                before_commit=before_commit):
            _best_effort_delete(store, partial)
            _kept_theirs(store, meta.step)
            return None
    except BaseException:
        _best_effort_delete(store, partial)
        raise
    return manifest


def _persist_manifest_last(store: Store, payload: Any, meta: SnapshotMeta,
                           final: str, before_commit: Callable[[], None],
                           pace: Pace | None) -> Manifest | None:
    name = layout.payload_name(uuid.uuid4().hex[:12])
    with store.open_write(f"{final}/{name}") as sink:
        size, checksum = serialize_payload(payload, sink, meta.checksum_algorithm,
                                           pace)
    manifest = _manifest(meta, size, checksum, name)
    before_commit()
    if not commit_in_place(store, meta.step, manifest.to_json(), exclusive=True):
        return _after_lost_race(store, meta, final, manifest)
    return manifest


def _after_lost_race(store: Store, meta: SnapshotMeta, final: str,
                     ours: Manifest) -> Manifest | None:
    """The manifest already existed: ours if a retried PUT's first response was lost,
    else another writer's, which must verify; our payload is then an orphan."""
    theirs = read_manifest(store, meta.step)
    if theirs.objects == ours.objects:  # the names carry our unique token
        return ours
    _best_effort_delete(store, f"{final}/{ours.objects[0].name}")
    _kept_theirs(store, meta.step)
    return None


def _kept_theirs(store: Store, step: int) -> None:
    """Another writer committed ``step`` first: theirs must verify (else raise)."""
    verify_snapshot(store, step)
    log.info("snapshot.exists", snapshot_step=step, action="kept",
             reason="another writer committed this step first")


def _best_effort_delete(store: Store, path: str) -> None:
    with contextlib.suppress(StorageError):  # retention clears it later
        store.delete(path, recursive=True)
