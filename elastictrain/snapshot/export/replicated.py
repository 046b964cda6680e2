"""A replicated snapshot's payload (one ``torch.save`` file) read one tensor at a time.

The payload keeps its tensors as views into a few large storages (one per part of the
state and dtype), so a storage is no unit to read: each tensor's own byte range is.
``torch.load(mmap=True)`` supplies the structure and where each storage lies in the
file (``format/onepass.py``, its mapping never read); the file is then read front to
back once: each wanted tensor's range into memory of that tensor's size, everything
else through a small buffer, every byte hashed in file order. ``finish`` compares that
checksum with the manifest's: the caller keeps what it wrote only if they match.

A payload on an object store is first copied to a local temporary file (``TMPDIR``),
a chunk at a time, and read from there.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from elastictrain.core import layout
from elastictrain.core.errors import (
    ObjectSizeMismatch,
    SnapshotCorrupt,
    SnapshotUnloadable,
    StorageNotFoundError,
)
from elastictrain.snapshot.export.contents import TensorRef
from elastictrain.snapshot.format import onepass
from elastictrain.snapshot.format.checksum import new_hasher
from elastictrain.snapshot.format.manifest import Manifest, ObjectEntry
from elastictrain.snapshot.format.reader import payload_entry, verify_snapshot
from elastictrain.snapshot.format.tensorbytes import tensor_bytes
from elastictrain.snapshot.format.views import ViewRef, map_leaves
from elastictrain.storage.api import Store

_CHUNK = 64 << 20  # bytes per read (and per hash update) of a tensor's range
_SCRATCH = 8 << 20  # bytes of the buffer that takes what lies between wanted tensors


@dataclass(frozen=True)
class _Span:
    """A saved tensor: ``nbytes`` from file ``offset`` hold its elements, as a view of
    ``size``/``stride`` starting at the first of them."""

    offset: int
    nbytes: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class ReplicatedSource:
    """The model and optimizer of a format-1 snapshot, read tensor by tensor.

    Call order: ``tree`` (at once) → ``tensors(wanted)`` (one pass) → ``finish()``
    (raises unless the whole payload matched its manifest) → ``close()``.

    Raises (from the constructor):
        SnapshotCorrupt: no single payload, a missing one, or one of another size; or
            one whose layout does not parse and whose checksum fails.
        SnapshotUnloadable: the payload verifies but is no torch file of tensors.
        StorageError: a read failed (after the store's retries).
    """

    def __init__(self, store: Store, manifest: Manifest) -> None:
        self._manifest = manifest
        self._entry = payload_entry(manifest, f"{store.url}/{layout.step_dir(manifest.step)}")
        path = f"{layout.step_dir(manifest.step)}/{self._entry.name}"
        self._where = f"{store.url}/{path}"
        self._files = contextlib.ExitStack()
        try:
            local = store.local_path(path)
            spooled = local is None
            if local is None:
                local = _spool(store, path, self._entry, self._where)
                self._files.callback(os.unlink, local)
            _check_size(local, self._entry, self._where)
            plan = onepass.plan(local)
            if plan is None:  # corrupt, or it verifies and is no torch file: the checksum says
                verify_snapshot(store, manifest.step, manifest=manifest)
                raise SnapshotUnloadable(f"{self._where}: the checksum verifies but the "
                                         "payload is no torch file of tensors that this "
                                         "elastictrain reads; nothing was exported; fix: "
                                         "export it with the elastictrain version that "
                                         "wrote it (elastictrain snapshots inspect)")
            f = self._files.enter_context(open(local, "rb") if spooled else  # noqa: SIM115
                                          _through_store(store, path, self._where))
        except BaseException:
            self._files.close()
            raise
        self._hashed = _HashedFile(f, self._entry.size_bytes,
                                   new_hasher(manifest.checksum_algorithm))
        regions = {r.storage: r for r in plan.regions}
        saved = plan.skeleton if isinstance(plan.skeleton, dict) else {}
        self.tree: dict[str, Any] = {k: _refs(saved.get(k), regions)
                                     for k in ("model", "optimizer")}

    def order(self, wanted: list[TensorRef]) -> list[TensorRef]:
        """The order ``tensors`` reads them in: the file's."""
        return sorted(wanted, key=lambda ref: -1 if ref.where is None else ref.where.offset)

    def tensors(self, wanted: list[TensorRef]) -> Iterator[tuple[TensorRef, torch.Tensor]]:
        """Each wanted tensor, contiguous, in file order (``order``); the caller owns it."""
        for ref in self.order(wanted):
            yield ref, _read_tensor(self._hashed, ref)

    def finish(self) -> None:
        """Hash what was not read yet; raise unless the payload matches its manifest.

        Raises:
            SnapshotCorrupt: the checksum differs (what was read is not the snapshot).
        """
        actual = self._hashed.finish()
        if actual != self._entry.checksum:
            raise SnapshotCorrupt(f"{self._where}: {self._manifest.checksum_algorithm} "
                                  f"{actual} != manifest {self._entry.checksum}")

    def close(self) -> None:
        """Close the payload (and delete a local copy of a remote one)."""
        self._files.close()


@contextlib.contextmanager
def _through_store(store: Store, path: str, where: str) -> Iterator[BinaryIO]:
    """A local payload, opened through its store (whose faults and errors apply)."""
    try:
        with store.open_read(path) as f:
            yield f
    except StorageNotFoundError as exc:
        raise SnapshotCorrupt(f"{where}: missing ({exc})") from exc


def _refs(saved: Any, regions: dict[int, onepass.Region]) -> Any:
    """The saved structure with a TensorRef for every tensor (a plain empty tensor, whose
    storage holds no bytes, stays itself: ``_read_tensor`` makes a fresh one)."""
    def ref(value: Any) -> Any:
        if isinstance(value, ViewRef):
            return TensorRef(value.dtype, value.size, _span(value, regions[value.storage]))
        if isinstance(value, torch.Tensor):
            return TensorRef(value.dtype, tuple(value.shape), None)
        return value

    return map_leaves(saved, ref)


def _span(view: ViewRef, region: onepass.Region) -> _Span | None:
    """The file range of a view's elements (None when it has none)."""
    if not all(view.size):
        return None
    itemsize = view.dtype.itemsize
    extent = 1 + sum((n - 1) * s for n, s in zip(view.size, view.stride, strict=True))
    return _Span(region.offset + view.offset * itemsize, extent * itemsize, view.size,
                 view.stride)


def _read_tensor(hashed: _HashedFile, ref: TensorRef) -> torch.Tensor:
    span: _Span | None = ref.where
    if span is None:
        return torch.empty(ref.shape, dtype=ref.dtype)
    flat = torch.empty(span.nbytes // ref.dtype.itemsize, dtype=ref.dtype)
    hashed.read_at(span.offset, tensor_bytes(flat))
    return flat.as_strided(span.size, span.stride).contiguous()


class _HashedFile:
    """Reads of one file at rising offsets, every byte of it hashed once, in order: the
    bytes between two reads are read through a small buffer and hashed too; a read
    that overlaps what was hashed (tensors sharing bytes) hashes only what is new."""

    def __init__(self, f: BinaryIO, size: int, hasher: Any) -> None:
        self._f, self._size, self._hasher = f, size, hasher
        self._hashed = 0
        self._scratch = memoryview(bytearray(_SCRATCH))

    def read_at(self, offset: int, into: memoryview) -> None:
        self._skip_to(offset)
        self._f.seek(offset)
        done = 0
        while done < into.nbytes:
            view = into[done:done + _CHUNK]
            _fill(self._f, view, offset + done)
            new = offset + done + view.nbytes - self._hashed
            if new > 0:
                self._hasher.update(view[max(view.nbytes - new, 0):])
                self._hashed += min(new, view.nbytes)
            done += view.nbytes

    def finish(self) -> str:
        self._skip_to(self._size)
        return str(self._hasher.hexdigest())

    def _skip_to(self, offset: int) -> None:
        self._f.seek(self._hashed)
        while self._hashed < offset:
            view = self._scratch[:min(_SCRATCH, offset - self._hashed)]
            _fill(self._f, view, self._hashed)
            self._hasher.update(view)
            self._hashed += view.nbytes


def _fill(f: BinaryIO, view: memoryview, offset: int) -> None:
    got = 0
    while got < view.nbytes:
        n = f.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            raise SnapshotCorrupt(f"the payload ends after {offset + got} bytes "
                                  "(truncated while it was read?)")
        got += n


def _check_size(local: str, entry: ObjectEntry, where: str) -> None:
    try:
        size = os.path.getsize(local)
    except FileNotFoundError as exc:
        raise SnapshotCorrupt(f"{where}: missing ({exc})") from exc
    if size != entry.size_bytes:
        raise SnapshotCorrupt(f"{where}: {size} bytes, manifest says {entry.size_bytes} "
                              "(truncated?)")


def _spool(store: Store, path: str, entry: ObjectEntry, where: str) -> str:
    """A remote payload copied to a local temporary file, ``_CHUNK`` bytes at a time
    (checked later, by the pass over the copy). Returns its path."""
    fd, spool = tempfile.mkstemp(prefix="elastictrain-export-", suffix=".pt")
    chunk = memoryview(bytearray(min(_CHUNK, max(entry.size_bytes, 1))))
    try:
        with os.fdopen(fd, "wb") as f:
            for offset in range(0, entry.size_bytes, _CHUNK):
                view = chunk[:min(_CHUNK, entry.size_bytes - offset)]
                try:
                    store.read_into(path, view, offset, object_size=entry.size_bytes)
                except StorageNotFoundError as exc:
                    raise SnapshotCorrupt(f"{where}: missing ({exc})") from exc
                except ObjectSizeMismatch as exc:
                    raise SnapshotCorrupt(f"{where}: {exc.actual} bytes, manifest says "
                                          f"{entry.size_bytes} (truncated?)") from exc
                f.write(view)
    except BaseException:
        os.unlink(spool)
        raise
    return spool
