"""Discovery and verified loading of committed snapshots.

A snapshot exists only if its ``MANIFEST.json`` exists and parses; it is used
only if every payload object has the recorded size and checksum. Discovery
lists fresh, walks from the newest step down, and logs ``snapshot.corrupt``
for each candidate it skips: never silent, never deleted here.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from typing import Any

import torch

from elastictrain.config import ChecksumAlgorithm
from elastictrain.errors import SnapshotCorrupt, SnapshotNotFound, StorageError
from elastictrain.log import get_logger
from elastictrain.snapshot import layout
from elastictrain.snapshot.checksum import checksum_bytes, new_hasher
from elastictrain.snapshot.manifest import Manifest
from elastictrain.storage.api import Store

log = get_logger("elastictrain.snapshot")


@dataclass(frozen=True)
class VerifiedSnapshot:
    """A snapshot whose payload matched its manifest: its bytes, or (local storage,
    ``stream_local``) the path of the verified file, to be memory-mapped."""

    manifest: Manifest
    payload: bytes
    local_path: str | None = None

    @property
    def step(self) -> int:
        return self.manifest.step

    def load(self) -> dict[str, Any]:
        """The deserialized payload (weights_only; a local file is memory-mapped)."""
        if self.local_path is not None:
            return load_payload_file(self.local_path)
        return load_payload(self.payload)


def list_snapshot_dirs(store: Store, names: list[str] | None = None) -> list[int]:
    """Steps of every ``step_…`` directory, newest first (committed or not)."""
    names = store.list_dir(layout.SNAPSHOTS) if names is None else names
    steps = (layout.parse_step(n) for n in names)
    return sorted((s for s in steps if s is not None), reverse=True)


def read_manifest(store: Store, step: int) -> Manifest:
    """The parsed manifest of ``step``.

    Raises:
        SnapshotCorrupt: missing (an uncommitted, partial snapshot) or invalid.
    """
    where = f"{store.url}/{layout.step_dir(step)}"
    try:
        raw = store.read_bytes(f"{layout.step_dir(step)}/{layout.MANIFEST}")
    except StorageError as exc:
        raise SnapshotCorrupt(f"{where}: no readable {layout.MANIFEST} (partial write?): "
                              f"{exc}") from exc
    manifest = Manifest.from_json(raw, where)
    if manifest.step != step:
        raise SnapshotCorrupt(f"{where}: manifest says step {manifest.step}")
    return manifest


def read_verified(store: Store, step: int, stream_local: bool = False) -> VerifiedSnapshot:
    """Read the payload of ``step`` and check it against the manifest.

    With ``stream_local`` and a local store the file is checked in 8 MiB chunks and not
    kept in memory: restoring 1 GiB then allocates no 1 GiB buffer for the bytes and
    another for the tensors (first-touch page faults made that ~10 s on 2 busy cores).

    Raises:
        SnapshotCorrupt: missing manifest, missing object, wrong size or checksum.
    """
    manifest = read_manifest(store, step)
    where = f"{store.url}/{layout.step_dir(step)}"
    (entry,) = [o for o in manifest.objects if o.name == layout.PAYLOAD]
    local = store.local_path(f"{layout.step_dir(step)}/{entry.name}") if stream_local else None
    if local is not None:
        _verify_file(local, entry.size_bytes, entry.checksum, manifest.checksum_algorithm,
                     f"{where}/{entry.name}")
        return VerifiedSnapshot(manifest, b"", local)
    try:
        data = store.read_bytes(f"{layout.step_dir(step)}/{entry.name}")
    except StorageError as exc:
        raise SnapshotCorrupt(f"{where}/{entry.name}: unreadable: {exc}") from exc
    if len(data) != entry.size_bytes:
        raise SnapshotCorrupt(f"{where}/{entry.name}: {len(data)} bytes, manifest says "
                              f"{entry.size_bytes} (truncated?)")
    actual = checksum_bytes(data, manifest.checksum_algorithm)
    if actual != entry.checksum:
        raise SnapshotCorrupt(f"{where}/{entry.name}: {manifest.checksum_algorithm} {actual} "
                              f"!= manifest {entry.checksum}")
    return VerifiedSnapshot(manifest, data)


def _verify_file(path: str, size: int, checksum: str, algorithm: ChecksumAlgorithm,
                 where: str) -> None:
    hasher = new_hasher(algorithm)
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    total = 0
    try:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                hasher.update(view[:n])
                total += n
    except OSError as exc:
        raise SnapshotCorrupt(f"{where}: unreadable: {exc}") from exc
    if total != size:
        raise SnapshotCorrupt(f"{where}: {total} bytes, manifest says {size} (truncated?)")
    if hasher.hexdigest() != checksum:
        raise SnapshotCorrupt(f"{where}: {algorithm} {hasher.hexdigest()} != manifest {checksum}")


def verify_snapshot(store: Store, step: int) -> Manifest:
    """Verify ``step`` fully; return its manifest (raises SnapshotCorrupt)."""
    return read_verified(store, step).manifest


def find_latest_verified(store: Store, max_step: int | None = None,
                         stream_local: bool = False) -> VerifiedSnapshot | None:
    """The newest snapshot that verifies, logging ``snapshot.corrupt`` for each one
    skipped on the way; None when there is none at all (``stream_local``: see
    :func:`read_verified`)."""
    for step in list_snapshot_dirs(store):
        if max_step is not None and step > max_step:
            continue
        started = time.perf_counter()
        try:
            found = read_verified(store, step, stream_local)
        except SnapshotCorrupt as exc:
            log.warning("snapshot.corrupt", snapshot_step=step, reason=str(exc),
                        action="skipped, trying the previous snapshot")
            continue
        log.info("snapshot.discovered", snapshot_step=step,
                 size_bytes=found.manifest.total_bytes,
                 duration_s=round(time.perf_counter() - started, 4))
        return found
    return None


def load_payload(data: bytes) -> dict[str, Any]:
    """Deserialize a verified payload. Never unpickles arbitrary objects."""
    obj = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    if not isinstance(obj, dict):
        raise SnapshotCorrupt(f"payload is a {type(obj).__name__}, expected a dict")
    return obj


def load_payload_file(path: str) -> dict[str, Any]:
    """Deserialize a verified local payload, memory-mapped. Never unpickles arbitrary objects.

    Model tensors stay mapped: ``load_state_dict`` copies them into the parameters, so
    no second copy is made. Everything else is copied now, because optimizers keep the
    tensors they are given: a mapping held for the whole run would keep the file open
    (NFS then cannot delete the snapshot directory when retention removes it).
    """
    obj = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
    if not isinstance(obj, dict):
        raise SnapshotCorrupt(f"payload is a {type(obj).__name__}, expected a dict")
    return {k: v if k == "model" else _cloned(v) for k, v in obj.items()}


def _cloned(node: Any) -> Any:
    if isinstance(node, torch.Tensor):
        return node.clone()
    if isinstance(node, dict):  # OrderedDict stays OrderedDict
        return type(node)((k, _cloned(v)) for k, v in node.items())
    if isinstance(node, (list, tuple)):
        return type(node)(_cloned(v) for v in node)
    return node


def load_step(store: Store, step: int) -> dict[str, Any]:
    """Verify and load one snapshot by step (operator tooling, tests)."""
    if layout.step_dir(step).rsplit("/", 1)[1] not in store.list_dir(layout.SNAPSHOTS):
        raise SnapshotNotFound(f"{store.url}: no snapshot for step {step}; fix: "
                               "`elastictrain snapshots list` shows the committed steps")
    return load_payload(read_verified(store, step).payload)
