"""Discovery and verified loading of committed snapshots.

A snapshot exists only if its ``MANIFEST.json`` exists and parses; it is used
only if every payload object has the recorded size and checksum. Discovery
lists fresh, walks from the newest step down, and logs ``snapshot.corrupt``
for each candidate it skips: never silent, never deleted here.
"""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from elastictrain.errors import SnapshotCorrupt, StorageError
from elastictrain.log import get_logger
from elastictrain.snapshot import layout
from elastictrain.snapshot.checksum import checksum_bytes, new_hasher
from elastictrain.snapshot.manifest import SHARDED_FORMAT_VERSION, Manifest, ObjectEntry
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


def _payload_entry(manifest: Manifest, where: str) -> ObjectEntry:
    """The manifest's one payload object (its name is unique per writer on object stores)."""
    payloads = [o for o in manifest.objects if layout.is_payload(o.name)]
    if len(payloads) != 1:
        raise SnapshotCorrupt(f"{where}: manifest names {len(payloads)} payload objects, "
                              "expected 1")
    return payloads[0]


def read_verified(store: Store, step: int) -> VerifiedSnapshot:
    """Read the payload of ``step`` and check it against the manifest.

    Raises:
        SnapshotCorrupt: missing manifest, missing object, wrong size or checksum.
    """
    manifest = read_manifest(store, step)
    where = f"{store.url}/{layout.step_dir(step)}"
    entry = _payload_entry(manifest, where)
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
    manifest = read_manifest(store, step)
    if manifest.format_version == SHARDED_FORMAT_VERSION:
        from elastictrain.snapshot.sharded.commit import verify_sharded  # imports the writer

        return verify_sharded(store, manifest)
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


def load_payload(data: bytes | BinaryIO) -> dict[str, Any]:
    """Deserialize a payload (bytes or a seekable file). Never unpickles arbitrary objects."""
    source = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    obj = torch.load(source, weights_only=True, map_location="cpu")
    if not isinstance(obj, dict):
        raise SnapshotCorrupt(f"payload is a {type(obj).__name__}, expected a dict")
    return obj


def load_verified(store: Store, step: int) -> tuple[Manifest, dict[str, Any]]:
    """Read, verify and deserialize ``step`` in one pass where the store is local.

    A local payload is deserialized straight from the file while its checksum
    is computed over the same reads (``_VerifyingReader``): one read of the
    bytes instead of read → checksum → copy out of a byte string. The state is
    used only after the whole file verified; deserializing unverified bytes is
    safe because loading never unpickles anything but tensors and containers.
    Other stores read the object once into memory, verify, then deserialize.

    Raises:
        SnapshotCorrupt: missing manifest or payload, wrong size or checksum, or
            a payload that does not deserialize.
    """
    manifest = read_manifest(store, step)
    entry = _payload_entry(manifest, f"{store.url}/{layout.step_dir(step)}")
    path = f"{layout.step_dir(step)}/{entry.name}"
    local = store.local_path(path)
    if local is None:
        return manifest, load_payload(read_verified(store, step).payload)
    where = f"{store.url}/{path}"
    try:
        f = open(local, "rb", buffering=0)  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise SnapshotCorrupt(f"{where}: unreadable: {exc}") from exc
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != entry.size_bytes:
            raise SnapshotCorrupt(f"{where}: {size} bytes, manifest says {entry.size_bytes} "
                                  "(truncated?)")
        reader = _VerifyingReader(f, size, manifest.checksum_algorithm)
        try:
            payload = load_payload(reader)  # type: ignore[arg-type]
        except SnapshotCorrupt:
            raise
        except Exception as exc:  # a damaged zip or pickle: report it as corruption
            raise SnapshotCorrupt(f"{where}: does not deserialize "
                                  f"({type(exc).__name__}: {exc})") from exc
        actual = reader.finish()
    if actual != entry.checksum:
        raise SnapshotCorrupt(f"{where}: {manifest.checksum_algorithm} {actual} "
                              f"!= manifest {entry.checksum}")
    return manifest, payload


class _VerifyingReader(io.RawIOBase):
    """A seekable file reader that checksums the file while ``torch.load`` reads it.

    ``torch.load`` reads the zip directory at the end first, then the records
    front to back. Bytes are hashed whenever a read continues the hashed
    prefix; a small gap before a read (a record header) is read and hashed on
    the spot; anything left when loading is done (the directory) is hashed by
    ``finish``. The result is the checksum of the whole file, in order, for any
    read pattern: an unusual one only costs extra reads.
    """

    _GAP_LIMIT = 1 << 20
    _CHUNK = 8 << 20

    def __init__(self, f: BinaryIO, size: int, algorithm: Any) -> None:
        super().__init__()
        self._fd = f.fileno()
        self._size = size
        self._pos = 0
        self._hashed = 0
        self._hasher = new_hasher(algorithm)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        while done < view.nbytes:  # one pread returns at most ~2 GiB on Linux
            n = os.preadv(self._fd, [view[done:]], self._pos + done)
            if n == 0:
                break
            done += n
        self._cover(self._pos, view[:done])
        self._pos += done
        return done

    def _cover(self, pos: int, data: memoryview) -> None:
        end = pos + data.nbytes
        if end <= self._hashed:
            return
        if pos > self._hashed:
            if pos - self._hashed > self._GAP_LIMIT:
                return  # far ahead (the zip directory): hashed in order later
            self._hasher.update(os.pread(self._fd, pos - self._hashed, self._hashed))
            self._hashed = pos
        self._hasher.update(data[self._hashed - pos:])
        self._hashed = end

    def finish(self) -> str:
        """Hash whatever was not read in order yet; return the whole file's checksum."""
        chunk = bytearray(min(self._CHUNK, max(self._size - self._hashed, 1)))
        while self._hashed < self._size:
            n = os.preadv(self._fd, [chunk], self._hashed)
            if n == 0:
                break
            self._hasher.update(memoryview(chunk)[:n])
            self._hashed += n
        return self._hasher.hexdigest()


