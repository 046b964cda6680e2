"""Restore of a local payload in one pass over its bytes.

``torch.load`` of a stream reads every storage into memory torch allocates, one
page fault per 4 KiB page, and the checksum is a second walk over what it read.
Here ``torch.load(mmap=True)`` supplies only the state's structure and which file
range each storage occupies (its mapping is never read), and the file is then
read front to back, once: each storage's range straight into the memory the
restored tensor keeps, everything between (zip headers, the pickle, the
directory) into a small scratch buffer, every chunk hashed in file order (on a
second thread, while the next chunk is read). The caller uses the state only
when that checksum matches the manifest.

With ``InPlace`` targets (the model's own tensors), the ranges of the tensors
that match one exactly are read straight into them instead: the model's memory
is already mapped, and ``load_state_dict`` then copies nothing. Those tensors
hold unverified bytes until the checksum is known (``InPlace.touched``); what
that means for restore is settled in restore.py.

Reads go through the store's ``open_read``, so a failed read is a storage error
(and fault-injecting stores see it); nothing here maps file pages it reads, so
an I/O error is an exception, never a SIGBUS. A payload whose layout is not the
one recognised here (``plan`` returns None) is streamed by the caller instead.
Figures: docs/restore.md.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import struct
import sys
import threading
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from elastictrain.core.config import ChecksumAlgorithm
from elastictrain.snapshot.format.checksum import Hasher, new_hasher
from elastictrain.snapshot.format.tensorbytes import tensor_bytes
from elastictrain.snapshot.format.views import (
    InPlace,
    StatePath,
    StorageIndex,
    ViewRef,
    from_views,
    to_views,
)

_CHUNK = 64 << 20  # bytes per read and hash: large reads, a hash while the chunk is cached
_SCRATCH = 8 << 20  # bytes of the buffer that takes everything between storages
_PAGE = 4096
_MADV_POPULATE_WRITE = 23  # linux/mman.h; mmap has no name for it before Python 3.13
_DATA_RECORD = re.compile(r"[^/]+/data/\d+")
_LOCAL_HEADER = 30  # bytes of a zip local file header before its name and extra field


@dataclass(frozen=True)
class Region:
    """Storage number ``storage`` of the skeleton lies at ``offset`` in the file."""

    offset: int
    nbytes: int
    storage: int


@dataclass(frozen=True)
class Plan:
    """The state's skeleton and where its storages lie, in file order."""

    skeleton: Any
    regions: list[Region]




@dataclass(frozen=True)
class _Placement:
    """File range ``offset``/``nbytes`` goes into ``receiver``, which then stands in the
    loaded state at every one of ``paths``."""

    offset: int
    nbytes: int
    receiver: torch.Tensor
    paths: tuple[StatePath, ...]


def plan(path: str) -> Plan | None:
    """The layout of the payload at local ``path``, or None when it is not a plain
    uncompressed torch zip whose every storage is one recognised record (the
    caller then streams the payload; a payload that does not load at all is
    classified there too, by its checksum)."""
    try:
        payload = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        records = _record_offsets(path)
    except Exception:
        return None
    index = StorageIndex()
    skeleton = to_views(payload, index)
    storages = sorted(enumerate(index.storages), key=lambda item: item[1].data_ptr())
    if len(storages) != len(records):
        return None
    regions: list[Region] = []
    base: int | None = None
    for (number, storage), (offset, nbytes) in zip(storages, records, strict=True):
        # Every storage is a slice of one mapping of the file: the same distance
        # between address and file offset for all of them proves which bytes each holds.
        distance = storage.data_ptr() - offset
        if storage.nbytes() != nbytes or (base is not None and distance != base):
            return None
        base = distance
        regions.append(Region(offset, nbytes, number))
    return Plan(skeleton, regions)


def read(f: BinaryIO, size: int, layout: Plan, algorithm: ChecksumAlgorithm,
         in_place: InPlace | None = None) -> tuple[str, dict[str, Any]]:
    """Read the file ``f`` (``size`` bytes) once, front to back, into fresh storages
    and the ``in_place`` tensors that match a saved one exactly; return its checksum
    and the state built on them.

    Raises:
        OSError or the store's StorageError: a read failed or the file ended early.
    """
    scratch = memoryview(bytearray(_SCRATCH))
    storages = {r.storage: torch.empty(r.nbytes, dtype=torch.uint8) for r in layout.regions}
    placements = _placements(layout, in_place)
    pieces = list(_pieces(layout.regions, placements, storages))
    prefault = _Prefault([into for _, into, placed in pieces if not placed])
    hasher = _Hashing(new_hasher(algorithm))
    try:
        position = 0
        for offset, into, placed in pieces:
            _read_hashed(f, position, offset - position, hasher, scratch, reuse=True)
            if placed and in_place is not None:
                in_place.touched = True
            _read_hashed(f, offset, into.nbytes, hasher, _bytes_of(into), reuse=False)
            position = offset + into.nbytes
        _read_hashed(f, position, size - position, hasher, scratch, reuse=True)
        checksum = hasher.finish()
    finally:
        hasher.stop()
        prefault.stop()
    state = from_views(layout.skeleton, storages)
    for placement in placements:
        for path in placement.paths:
            _put(state, path, placement.receiver)
    return checksum, state


def _pieces(regions: list[Region], placements: list[_Placement],
            storages: Mapping[int, torch.Tensor]) -> Iterator[tuple[int, torch.Tensor, bool]]:
    """(file offset, where its bytes go, placed or not) for every storage byte, in file
    order: the placed ranges into their receivers, the rest into the fresh storages."""
    ordered = sorted(placements, key=lambda p: p.offset)
    for region in regions:
        fresh, cursor, end = storages[region.storage], region.offset, region.offset + region.nbytes
        for placement in (p for p in ordered if region.offset <= p.offset < end):
            if placement.offset > cursor:
                yield cursor, fresh[cursor - region.offset:placement.offset - region.offset], False
            yield placement.offset, _uint8(placement.receiver), True
            cursor = placement.offset + placement.nbytes
        if cursor < end:
            yield cursor, fresh[cursor - region.offset:], False


def _placements(layout: Plan, in_place: InPlace | None) -> list[_Placement]:
    """The saved tensors read straight into a target: same dtype and shape, both
    contiguous, and no other saved or receiving tensor sharing any of their bytes
    (those go through fresh memory, and ``load_state_dict`` copies them)."""
    if in_place is None or not in_place.targets:
        return []
    if in_place.precheck is not None:
        try:
            in_place.precheck(layout.skeleton)
        except Exception:
            return []  # reported by the caller's check of the verified state
    regions = {r.storage: r for r in layout.regions}
    saved = {path: span for path, span in _view_ranges(layout.skeleton, regions, ()) if span[1]}
    groups: dict[tuple[int, int, torch.dtype, tuple[int, ...]],
                 list[tuple[StatePath, torch.Tensor]]] = {}
    for path, target in in_place.targets.items():
        view = _lookup(layout.skeleton, path)
        if isinstance(view, ViewRef) and path in saved and _fits(view, target):
            groups.setdefault((*saved[path], view.dtype, view.size), []).append((path, target))
    # A group is placed only if the bytes it reads are read by nobody else, and the
    # memory it writes is written by nobody else (tied tensors inside it may coincide).
    in_file = _sharing([(start, start + n, path) for path, (start, n) in saved.items()])
    in_memory = _sharing([(t.data_ptr(), t.data_ptr() + t.nbytes, path)
                          for members in groups.values() for path, t in members])
    placements = []
    for (offset, nbytes, _, _), members in groups.items():
        paths = {path for path, _ in members}
        if all(in_file[p] <= paths and in_memory[p] <= paths for p in paths):
            placements.append(_Placement(offset, nbytes, members[0][1],
                                         tuple(p for p, _ in members)))
    return placements


def _sharing(spans: list[tuple[int, int, StatePath]]) -> dict[StatePath, set[StatePath]]:
    """For each span's path, the paths of every span that shares a byte with it,
    directly or through others (itself included)."""
    found: dict[StatePath, set[StatePath]] = {}
    group: set[StatePath] = set()
    reach = -1
    for start, end, path in sorted(spans, key=lambda span: span[:2]):
        if start >= reach:
            group = set()
        group.add(path)
        found[path] = group
        reach = max(reach, end)
    return found


def _view_ranges(skeleton: Any, regions: Mapping[int, Region],
                 path: StatePath) -> Iterator[tuple[StatePath, tuple[int, int]]]:
    """(path, (file offset, bytes)) of every saved tensor: its storage's record plus its
    offset, over the bytes a contiguous view of its size spans."""
    if isinstance(skeleton, ViewRef):
        region = regions.get(skeleton.storage)
        if region is not None:
            itemsize = skeleton.dtype.itemsize
            extent = 1 + sum((n - 1) * s for n, s in zip(skeleton.size, skeleton.stride,
                                                         strict=True))
            start = region.offset + skeleton.offset * itemsize
            yield path, (start, extent * itemsize if all(skeleton.size) else 0)
        return
    if isinstance(skeleton, dict):
        items: Any = skeleton.items()
    elif isinstance(skeleton, (list, tuple)):
        items = enumerate(skeleton)
    else:
        return
    for key, value in items:
        yield from _view_ranges(value, regions, (*path, key))


def _fits(view: ViewRef, target: torch.Tensor) -> bool:
    """``target`` can take the saved bytes as they are: a plain contiguous CPU tensor of
    the same dtype and shape as a contiguous saved one."""
    return (type(target) is torch.Tensor and target.device.type == "cpu"
            and target.dtype == view.dtype and tuple(target.shape) == view.size
            and target.numel() > 0 and target.is_contiguous()
            and view.stride == tuple(torch.empty(view.size, device="meta").stride()))


def _lookup(state: Any, path: StatePath) -> Any:
    for key in path:
        try:
            state = state[key]
        except (KeyError, IndexError, TypeError):
            return None
    return state


def _put(state: Any, path: StatePath, value: torch.Tensor) -> None:
    for key in path[:-1]:
        state = state[key]
    state[path[-1]] = value


def _uint8(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a uint8 tensor over the same memory."""
    return torch.empty(0, dtype=torch.uint8).set_(
        tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size(),
        (tensor.numel() * tensor.element_size(),), (1,))


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return tensor_bytes(tensor)


class _Prefault:
    """Maps the fresh storages' pages on a second thread while the reads fill them.

    Writing into fresh memory costs a page fault per 4 KiB page, as much as the copy
    from the page cache itself; ``MADV_POPULATE_WRITE`` (Linux >= 5.14) takes those
    faults ahead of the reads, on another core when one is free (a GPU node's CPU
    mostly is). It only maps pages, never writes them, so it cannot disturb bytes a
    read already placed. Where the kernel refuses it the reads fault as usual.
    """

    def __init__(self, targets: list[torch.Tensor]) -> None:  # uint8 tensors
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(targets,), daemon=True,
                                        name="et-prefault")
        self._thread.start()

    def _run(self, targets: list[torch.Tensor]) -> None:
        import ctypes

        if not sys.platform.startswith("linux"):
            return  # the advice's number means something else elsewhere
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        for target in targets:
            address, end = target.data_ptr(), target.data_ptr() + target.nbytes
            start = -(-address // _PAGE) * _PAGE
            for chunk in range(start, end - end % _PAGE, _CHUNK):
                length = min(_CHUNK, end - end % _PAGE - chunk)
                if self._stopped.is_set() or madvise(
                        ctypes.c_void_p(chunk), ctypes.c_size_t(length),
                        ctypes.c_int(_MADV_POPULATE_WRITE)) != 0:
                    return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


class _Hashing:
    """Hashes chunks on a second thread, in the order they are given, while the next
    chunk is read: the checksum leaves the read's critical path.

    A chunk whose buffer is about to be reused (the scratch buffer) is hashed with
    ``now``, after everything before it, so the order of the bytes never changes.
    """

    def __init__(self, hasher: Hasher) -> None:
        self._hasher = hasher
        self._queue: queue.Queue[memoryview | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="et-hash")
        self._thread.start()

    def _run(self) -> None:
        while True:
            view = self._queue.get()
            try:
                if view is None:
                    return
                self._hasher.update(view)  # releases the GIL
            finally:
                self._queue.task_done()

    def later(self, view: memoryview) -> None:
        self._queue.put(view)

    def now(self, view: memoryview) -> None:
        self._queue.join()
        self._hasher.update(view)

    def finish(self) -> str:
        self.stop()
        return self._hasher.hexdigest()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


def _read_hashed(f: BinaryIO, offset: int, nbytes: int, hasher: _Hashing,
                 into: memoryview, *, reuse: bool) -> None:
    """Read ``nbytes`` from ``offset``, hashing each chunk once it has landed: into
    consecutive slices of ``into`` (a storage, ``nbytes`` long), or with ``reuse``
    through its start over and over (the scratch buffer)."""
    f.seek(offset)
    done = 0
    while done < nbytes:
        n = min(nbytes - done, _CHUNK)
        view = into[:min(n, into.nbytes)] if reuse else into[done:done + n]
        _read_ahead(f, offset + done + view.nbytes)
        got = 0
        while got < view.nbytes:
            read = f.readinto(view[got:])  # type: ignore[attr-defined]
            if not read:
                raise OSError(f"the file ends after {offset + done + got} bytes, "
                              f"{offset + nbytes} expected")
            got += read
        if reuse:
            hasher.now(view)
        else:
            hasher.later(view)
        done += view.nbytes


def _read_ahead(f: BinaryIO, offset: int) -> None:
    """Ask the kernel to start reading the next chunk from disk now, while this one is
    copied and hashed (a plain read waits for its own bytes only)."""
    # Not a local file (or no fadvise): reads still work, without the overlap.
    with contextlib.suppress(OSError, AttributeError, ValueError):
        os.posix_fadvise(f.fileno(), offset, _CHUNK, os.POSIX_FADV_WILLNEED)


def _record_offsets(path: str) -> list[tuple[int, int]]:
    """(offset, size) of every non-empty storage record's data in the zip, in file order.

    Raises ValueError on a compressed record (torch.save never writes one).
    """
    found = []
    with open(path, "rb") as raw, zipfile.ZipFile(raw) as archive:
        for info in archive.infolist():
            if not _DATA_RECORD.fullmatch(info.filename) or info.file_size == 0:
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"{info.filename} is compressed")
            raw.seek(info.header_offset)
            header = raw.read(_LOCAL_HEADER)
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            found.append((info.header_offset + _LOCAL_HEADER + name_len + extra_len,
                          info.file_size))
    return sorted(found)
