"""Discovery and verification of committed snapshots: the one path that restore,
``elastictrain snapshots …`` and the demo's preflight share.

``newest_first`` yields every snapshot directory from the newest step down, with
its manifest or the reason it has none; ``verify_snapshot`` checks one snapshot's
payload size and checksum (the only place they are checked) and, with
``load=True``, deserializes it in the same pass over the bytes.

Corruption (``SnapshotCorrupt``) is a verified mismatch or a missing object: no
manifest, an invalid manifest or one for another step, a missing payload, a wrong
size or checksum. Any other storage error (throttling, a timeout, denied access)
has already been retried by the store and is raised as it is: a read error never
makes a snapshot look corrupt. A payload that verifies but does not deserialize
raises ``SnapshotUnloadable``. Nothing here deletes anything. See docs/restore.md.
"""

from __future__ import annotations

import io
import mmap
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

from elastictrain.core import layout
from elastictrain.core.config import ChecksumAlgorithm
from elastictrain.core.errors import (
    ObjectSizeMismatch,
    SnapshotCorrupt,
    SnapshotUnloadable,
    StorageNotFoundError,
)
from elastictrain.core.log import get_logger
from elastictrain.snapshot.format import signing
from elastictrain.snapshot.format.checksum import new_hasher
from elastictrain.snapshot.format.commitmark import read_marker
from elastictrain.snapshot.format.manifest import SHARDED_FORMAT_VERSION, Manifest, ObjectEntry
from elastictrain.snapshot.format.sharded_reader import verify_sharded
from elastictrain.storage.api import Store

if TYPE_CHECKING:
    from elastictrain.snapshot.format.views import InPlace

log = get_logger("elastictrain.snapshot")


@dataclass(frozen=True)
class Candidate:
    """One snapshot directory: its manifest when committed, else why it has none."""

    step: int
    manifest: Manifest | None
    problem: str | None = None


@dataclass(frozen=True)
class VerifiedSnapshot:
    """A snapshot whose payload matched its manifest; ``payload`` when it was loaded."""

    manifest: Manifest
    payload: dict[str, Any] | None

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
        SnapshotCorrupt: missing (an uncommitted, partial snapshot), invalid, or for
            another step.
        StorageError: the read failed for another reason (after the store's retries).
    """
    where = f"{store.url}/{layout.step_dir(step)}"
    try:
        raw = read_marker(store, step)
    except StorageNotFoundError as exc:
        raise SnapshotCorrupt(f"{where}: no {layout.MANIFEST} (not committed: a partial "
                              "write?)") from exc
    manifest = Manifest.from_json(raw, where)
    signing.check(manifest, where)
    if manifest.step != step:
        raise SnapshotCorrupt(f"{where}: manifest says step {manifest.step}")
    return manifest


def newest_first(store: Store) -> Iterator[Candidate]:
    """Every snapshot directory from a fresh listing, newest step first, each with its
    manifest or the reason it has none. Read errors other than a missing or invalid
    manifest are raised."""
    for step in list_snapshot_dirs(store):
        try:
            yield Candidate(step, read_manifest(store, step))
        except SnapshotCorrupt as exc:
            yield Candidate(step, None, str(exc))


def verify_snapshot(store: Store, step: int, *, manifest: Manifest | None = None,
                    load: bool = False,
                    in_place: InPlace | None = None) -> VerifiedSnapshot:
    """Check ``step``'s payload against its manifest; with ``load``, deserialize it
    while its checksum is computed over the same reads.

    The payload is streamed (never read whole into memory). A loaded state is used
    only once the whole object verified; deserializing unverified bytes is safe
    because loading never unpickles anything but tensors and plain containers.

    Args:
        manifest: the already read manifest of ``step`` (read here when None).
        load: also return the deserialized state.
        in_place: existing tensors a local one-pass read may fill directly
            (snapshot/format/onepass.py); they hold unverified bytes once ``touched``,
            whatever this raises.

    Raises:
        SnapshotCorrupt: missing or invalid manifest, missing payload, wrong size or
            checksum.
        SnapshotUnloadable: the payload verifies but ``torch.load(weights_only=True)``
            refuses it.
        StorageError: a read failed (after the store's retries).
    """
    manifest = manifest if manifest is not None else read_manifest(store, step)
    if manifest.format_version == SHARDED_FORMAT_VERSION:
        return VerifiedSnapshot(verify_sharded(store, manifest), None)
    where = f"{store.url}/{layout.step_dir(step)}"
    entry = payload_entry(manifest, where)
    path = f"{layout.step_dir(step)}/{entry.name}"
    where = f"{store.url}/{path}"
    local = store.local_path(path)
    if local is None:  # remote: few large parallel reads, not a stream
        if not load:
            _check_remote(store, path, entry, manifest.checksum_algorithm, where)
            return VerifiedSnapshot(manifest, None)
        spooled = _verify_spooled(store, path, entry, manifest, where)
        if spooled is not None:
            return spooled
    elif load:
        one_pass = _load_one_pass(store, path, local, entry, manifest, where, in_place)
        if one_pass is not None:
            return one_pass
    try:
        with store.open_read(path) as f:
            size = f.seek(0, io.SEEK_END)
            _check_size(size, entry, where)
            reader = VerifyingReader(f, size, manifest.checksum_algorithm)
            payload, refused = _load(reader) if load else (None, None)
            actual = reader.finish()
    except StorageNotFoundError as exc:
        raise SnapshotCorrupt(f"{where}: missing ({exc})") from exc
    if actual != entry.checksum:
        raise _mismatch(where, manifest.checksum_algorithm, actual, entry) from refused
    if refused is not None:
        raise _unloadable(where, refused) from refused
    return VerifiedSnapshot(manifest, payload)


def find_latest_verified(store: Store) -> VerifiedSnapshot | None:
    """The newest snapshot that verifies, loaded, in this process alone (restore with
    a process group is ``restore.load_newest``); logs ``snapshot.corrupt`` for each one
    skipped on the way; None when there is none."""
    for candidate in newest_first(store):
        started = time.perf_counter()
        try:
            if candidate.manifest is None:
                raise SnapshotCorrupt(candidate.problem or "no manifest")
            found = verify_snapshot(store, candidate.step, manifest=candidate.manifest,
                                    load=True)
        except SnapshotCorrupt as exc:
            log.warning("snapshot.corrupt", snapshot_step=candidate.step, reason=str(exc),
                        action="skipped, trying the previous snapshot")
            continue
        log.info("snapshot.discovered", snapshot_step=candidate.step,
                 size_bytes=found.manifest.total_bytes,
                 duration_s=round(time.perf_counter() - started, 4))
        return found
    return None


def _verify_spooled(store: Store, path: str, entry: ObjectEntry, manifest: Manifest,
                    where: str) -> VerifiedSnapshot | None:
    """A remote payload read once, with parallel ranged GETs, into a local temporary
    file's pages; checked there, then loaded by ``torch.load(mmap=True)``, whose
    tensors use those pages (no second copy). torch.load streaming from the object
    store pays a round trip per record; this pays a few large reads (docs/restore.md).

    Returns None (the caller streams instead) when the local file cannot be made:
    ``TMPDIR`` without ``size`` free bytes, logged as ``snapshot.spool_skipped``.

    The size is the manifest's: the ranged GETs check the object's size from their
    own answers (a HEAD first would add a round trip and prove no more), and the
    whole payload is one ``read_into``, so its ranges run in parallel across all of it.
    """
    size = entry.size_bytes
    with tempfile.NamedTemporaryFile(prefix="elastictrain-restore-", suffix=".pt") as spool:
        try:
            # Reserve the blocks now: writing a mapping of a sparse file on a full disk
            # would kill the process with SIGBUS instead of raising.
            os.posix_fallocate(spool.fileno(), 0, max(size, 1))
        except OSError as exc:
            log.warning("snapshot.spool_skipped", path=where, size_bytes=size,
                        directory=tempfile.gettempdir(), error=str(exc),
                        fix="set TMPDIR to a local directory with room for one payload")
            return None
        mapped = mmap.mmap(spool.fileno(), max(size, 1))
        actual = _read_hashed(store, path, size, manifest.checksum_algorithm, where,
                              lambda offset, n: memoryview(mapped)[offset:offset + n],
                              chunk=max(size, 1))
        # Not closed on the error paths: the exception's frames may still hold views of
        # the mapping (closing would raise over the real error); it is unmapped when freed.
        mapped.close()
        if actual != entry.checksum:
            raise _mismatch(where, manifest.checksum_algorithm, actual, entry)
        import torch  # here, not at the top: listing and verifying need no torch

        try:
            payload = torch.load(spool.name, weights_only=True, map_location="cpu", mmap=True)
        except Exception as exc:
            raise _unloadable(where, exc) from exc
    if not isinstance(payload, dict):
        raise _unloadable(where, TypeError(f"payload is a {type(payload).__name__}, "
                                           "expected a dict"))
    return VerifiedSnapshot(manifest, payload)


def _load_one_pass(store: Store, path: str, local: str, entry: ObjectEntry,
                   manifest: Manifest, where: str,
                   in_place: InPlace | None) -> VerifiedSnapshot | None:
    """A local payload (at ``local`` on this machine) read once, straight into the
    restored tensors, its checksum computed on the way (snapshot/format/onepass.py); None
    (the caller streams) when its layout is not recognised."""
    from elastictrain.snapshot.format import onepass  # torch: not for the CLI's listings

    layout_plan = onepass.plan(local)
    if layout_plan is None:
        return None
    try:
        with store.open_read(path) as f:
            size = f.seek(0, io.SEEK_END)
            _check_size(size, entry, where)
            actual, payload = onepass.read(f, size, layout_plan, manifest.checksum_algorithm,
                                           in_place)
    except StorageNotFoundError as exc:
        raise SnapshotCorrupt(f"{where}: missing ({exc})") from exc
    if actual != entry.checksum:
        raise _mismatch(where, manifest.checksum_algorithm, actual, entry)
    if not isinstance(payload, dict):
        raise _unloadable(where, TypeError(f"payload is a {type(payload).__name__}, "
                                           "expected a dict"))
    return VerifiedSnapshot(manifest, payload)


def _check_size(size: int, entry: ObjectEntry, where: str) -> None:
    if size != entry.size_bytes:
        raise _wrong_size(where, size, entry.size_bytes)


def _wrong_size(where: str, actual: int, expected: int) -> SnapshotCorrupt:
    return SnapshotCorrupt(f"{where}: {actual} bytes, manifest says {expected} (truncated?)")


# Bytes per read_into (parallel ranged GETs) of a remote payload that is checked, not
# loaded: the memory a verification holds. Larger chunks mean fewer, larger ranges: a
# server that reads the whole object for every range (moto) pays that once per range
# (docs/benchmarks.md#s3-benchmark).
_VERIFY_CHUNK = 256 << 20


def _check_remote(store: Store, path: str, entry: ObjectEntry, algorithm: ChecksumAlgorithm,
                  where: str) -> None:
    """Size and checksum of a remote payload, read through one reused chunk (not loaded);
    the size is checked by the reads themselves (``_read_hashed``)."""
    size = entry.size_bytes
    chunk = bytearray(min(size, _VERIFY_CHUNK))
    actual = _read_hashed(store, path, size, algorithm, where,
                          lambda _, n: memoryview(chunk)[:n], chunk=_VERIFY_CHUNK)
    if actual != entry.checksum:
        raise _mismatch(where, algorithm, actual, entry)


def _read_hashed(store: Store, path: str, size: int, algorithm: ChecksumAlgorithm,
                 where: str, into: Callable[[int, int], memoryview], chunk: int) -> str:
    """Read ``path`` ``chunk`` bytes at a time into ``into(offset, nbytes)``, hashing each
    chunk as it lands; the whole object's checksum.

    Every read also checks that the object is ``size`` bytes (the manifest's), from the
    store's own answers: a missing or differently sized object is corrupt; any other
    failed read is raised as it is (it says nothing about the snapshot)."""
    hasher = new_hasher(algorithm)
    for offset in range(0, size, chunk):
        view = into(offset, min(chunk, size - offset))
        try:
            store.read_into(path, view, offset, object_size=size)
        except StorageNotFoundError as exc:
            raise SnapshotCorrupt(f"{where}: missing ({exc})") from exc
        except ObjectSizeMismatch as exc:
            raise _wrong_size(where, exc.actual, size) from exc
        hasher.update(view)
        view.release()
    return hasher.hexdigest()


def _mismatch(where: str, algorithm: ChecksumAlgorithm, actual: str,
              entry: ObjectEntry) -> SnapshotCorrupt:
    return SnapshotCorrupt(f"{where}: {algorithm} {actual} != manifest {entry.checksum}")


def payload_entry(manifest: Manifest, where: str) -> ObjectEntry:
    """The manifest's one payload object (its name is unique per writer on object stores)."""
    payloads = [o for o in manifest.objects if layout.is_payload(o.name)]
    if len(payloads) != 1:
        raise SnapshotCorrupt(f"{where}: manifest names {len(payloads)} payload objects, "
                              "expected 1")
    return payloads[0]


def _load(reader: VerifyingReader) -> tuple[dict[str, Any] | None, Exception | None]:
    """The deserialized payload, or the exception ``torch.load`` raised for it. Whether
    that exception means corruption is decided by the checksum, afterwards; a failed
    read is a read error whatever torch made of it."""
    import torch  # here, not at the top: listing and verifying need no torch

    try:
        obj = torch.load(reader, weights_only=True, map_location="cpu")  # type: ignore[arg-type]
    except Exception as exc:
        if reader.failure is not None:
            raise reader.failure from exc
        return None, exc
    if not isinstance(obj, dict):
        return None, TypeError(f"payload is a {type(obj).__name__}, expected a dict")
    return obj, None


def load_checked_bytes(data: bytes, where: str) -> dict[str, Any]:
    """Deserialize bytes already checked against their manifest.

    Raises:
        SnapshotUnloadable: ``torch.load(weights_only=True)`` refuses them.
    """
    obj, refused = _load(VerifyingReader(io.BytesIO(data), len(data), "crc32"))
    if refused is not None:
        raise _unloadable(where, refused) from refused
    assert obj is not None
    return obj


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _unloadable(where: str, exc: Exception) -> SnapshotUnloadable:
    found = _GLOBAL.search(str(exc))
    if found is None:
        first_line = (str(exc).strip().splitlines() or [""])[0]
        return SnapshotUnloadable(
            f"{where}: the checksum verifies but the payload does not deserialize "
            f"({type(exc).__name__}: {first_line}); the run stops (older snapshots of this "
            "script fail the same way); fix: save only tensors, numbers, strings and "
            "containers of them, and resume from a fresh --storage")
    from elastictrain.snapshot.format.loadable import runs_code  # torch: not for CLI listings

    name = found.group(1)
    if runs_code(name):  # no writer of elastictrain's puts a callable there: never allowlist
        return SnapshotUnloadable(
            f"{where}: the checksum verifies but the payload names {name}, a callable that "
            "runs code, which torch.load(weights_only=True) refused: the snapshot may have "
            "been tampered with (elastictrain never saves such a value); the run stops; "
            "fix: do not load it or allowlist anything; find out who can write this "
            "storage; set ELASTICTRAIN_SIGNING_KEY so that only snapshots signed with "
            "your key load; resume from the previous snapshot: list them with `elastictrain "
            "snapshots verify`, then move this step's directory aside (`elastictrain "
            "snapshots prune` would keep it: its checksum verifies)")
    return SnapshotUnloadable(
        f"{where}: the checksum verifies but torch.load(weights_only=True) refuses a "
        f"{name} in the saved state; the run stops (older snapshots of this script fail the "
        f"same way); fix: save it as a plain value (str, int, float, list, dict), or if you "
        f"trust the type call torch.serialization.add_safe_globals([{name}]) before "
        "restore()")


class VerifyingReader(io.RawIOBase):
    """A seekable reader over any seekable binary file that checksums the file while
    ``torch.load`` reads it.

    ``torch.load`` reads the zip directory at the end first, then the records
    front to back. Bytes are hashed whenever a read continues the hashed
    prefix; a small gap before a read (a record header) is read and hashed on
    the spot; anything left when loading is done (the directory) is hashed by
    ``finish``. The result is the checksum of the whole file, in order, for any
    read pattern: an unusual one only costs extra reads. Reads reach the file in
    pieces of at most ``_CHUNK`` bytes, so a remote file's copies stay bounded
    whatever the size of one tensor.
    """

    _GAP_LIMIT = 1 << 20
    _CHUNK = 8 << 20

    def __init__(self, f: BinaryIO, size: int, algorithm: ChecksumAlgorithm) -> None:
        super().__init__()
        self._f = f
        self._size = size
        self._pos = 0
        self._hashed = 0
        self._hasher = new_hasher(algorithm)
        self.failure: Exception | None = None  # the first failed read of the file

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
        done = self._read_at(self._pos, view)
        self._cover(self._pos, view[:done])
        self._pos += done
        return done

    def _read_at(self, pos: int, view: memoryview) -> int:
        try:
            self._f.seek(pos)
            done = 0
            while done < view.nbytes:
                n = self._f.readinto(view[done:done + self._CHUNK])  # type: ignore[attr-defined]
                if not n:
                    break
                done += n
            return done
        except Exception as exc:
            self.failure = self.failure or exc
            raise

    def _cover(self, pos: int, data: memoryview) -> None:
        end = pos + data.nbytes
        if end <= self._hashed:
            return
        if pos > self._hashed:
            if pos - self._hashed > self._GAP_LIMIT:
                return  # far ahead (the zip directory): hashed in order later
            gap = memoryview(bytearray(pos - self._hashed))
            self._hasher.update(gap[:self._read_at(self._hashed, gap)])
            self._hashed = pos
        self._hasher.update(data[self._hashed - pos:])
        self._hashed = end

    def finish(self) -> str:
        """Hash whatever was not read in order yet; return the whole file's checksum."""
        chunk = memoryview(bytearray(min(self._CHUNK, max(self._size - self._hashed, 1))))
        while self._hashed < self._size:
            n = self._read_at(self._hashed, chunk)
            if n == 0:
                break
            self._hasher.update(chunk[:n])
            self._hashed += n
        return self._hasher.hexdigest()

