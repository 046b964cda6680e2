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

from elastictrain.errors import SnapshotCorrupt, SnapshotNotFound, StorageError
from elastictrain.log import get_logger
from elastictrain.snapshot import layout
from elastictrain.snapshot.checksum import checksum_bytes
from elastictrain.snapshot.manifest import Manifest
from elastictrain.storage.api import Store

log = get_logger("elastictrain.snapshot")


@dataclass(frozen=True)
class VerifiedSnapshot:
    """A snapshot whose payload bytes matched its manifest."""

    manifest: Manifest
    payload: bytes

    @property
    def step(self) -> int:
        return self.manifest.step


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


def read_verified(store: Store, step: int) -> VerifiedSnapshot:
    """Read the payload of ``step`` and check it against the manifest.

    Raises:
        SnapshotCorrupt: missing manifest, missing object, wrong size or checksum.
    """
    manifest = read_manifest(store, step)
    where = f"{store.url}/{layout.step_dir(step)}"
    (entry,) = [o for o in manifest.objects if o.name == layout.PAYLOAD]
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


def verify_snapshot(store: Store, step: int) -> Manifest:
    """Verify ``step`` fully; return its manifest (raises SnapshotCorrupt)."""
    return read_verified(store, step).manifest


def find_latest_verified(store: Store, max_step: int | None = None) -> VerifiedSnapshot | None:
    """The newest snapshot that verifies, logging ``snapshot.corrupt`` for each one
    skipped on the way; None when there is none at all."""
    for step in list_snapshot_dirs(store):
        if max_step is not None and step > max_step:
            continue
        started = time.perf_counter()
        try:
            found = read_verified(store, step)
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


def load_step(store: Store, step: int) -> dict[str, Any]:
    """Verify and load one snapshot by step (operator tooling, tests)."""
    if layout.step_dir(step).rsplit("/", 1)[1] not in store.list_dir(layout.SNAPSHOTS):
        raise SnapshotNotFound(f"{store.url}: no snapshot for step {step}; fix: "
                               "`elastictrain snapshots list` shows the committed steps")
    return load_payload(read_verified(store, step).payload)
