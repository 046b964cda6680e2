"""Restore of a local payload in one pass over its bytes.

``torch.load`` of a stream reads every storage into memory torch allocates, one
page fault per 4 KiB page, and the checksum is a second walk over what it read.
Here ``torch.load(mmap=True)`` supplies only the state's structure and which file
range each storage occupies (its mapping is never read), and the file is then
read front to back, once: each storage's range straight into the memory the
restored tensor keeps, everything between (zip headers, the pickle, the
directory) into a small scratch buffer, every chunk hashed as it lands, in file
order. The caller uses the state only when that checksum matches the manifest.

Reads go through the store's ``open_read``, so a failed read is a storage error
(and fault-injecting stores see it); nothing here maps file pages it reads, so
an I/O error is an exception, never a SIGBUS. A payload whose layout is not the
one recognised here (``plan`` returns None) is streamed by the caller instead.
Figures: docs/restore.md.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import sys
import threading
import zipfile
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from elastictrain.config import ChecksumAlgorithm
from elastictrain.snapshot.checksum import Hasher, new_hasher
from elastictrain.snapshot.views import StorageIndex, from_views, to_views

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


def read(f: BinaryIO, size: int, layout: Plan,
         algorithm: ChecksumAlgorithm) -> tuple[str, dict[str, Any]]:
    """Read the file ``f`` (``size`` bytes) once, front to back, into fresh storages;
    return its checksum and the state built on those storages.

    Raises:
        OSError or the store's StorageError: a read failed or the file ended early.
    """
    hasher = new_hasher(algorithm)
    scratch = memoryview(bytearray(_SCRATCH))
    storages = {r.storage: torch.empty(r.nbytes, dtype=torch.uint8) for r in layout.regions}
    prefault = _Prefault([storages[r.storage] for r in layout.regions])
    try:
        position = 0
        for region in layout.regions:
            _read_hashed(f, position, region.offset - position, hasher, scratch, reuse=True)
            target = memoryview(storages[region.storage].numpy())  # type: ignore[arg-type]
            _read_hashed(f, region.offset, region.nbytes, hasher, target, reuse=False)
            position = region.offset + region.nbytes
        _read_hashed(f, position, size - position, hasher, scratch, reuse=True)
    finally:
        prefault.stop()
    return hasher.hexdigest(), from_views(layout.skeleton, storages)


class _Prefault:
    """Maps the fresh storages' pages on a second thread while the reads fill them.

    Writing into fresh memory costs a page fault per 4 KiB page, as much as the copy
    from the page cache itself; ``MADV_POPULATE_WRITE`` (Linux >= 5.14) takes those
    faults ahead of the reads, on another core when one is free (a GPU node's CPU
    mostly is). It only maps pages, never writes them, so it cannot disturb bytes a
    read already placed. Where the kernel refuses it the reads fault as usual.
    """

    def __init__(self, targets: list[torch.Tensor]) -> None:
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


def _read_hashed(f: BinaryIO, offset: int, nbytes: int, hasher: Hasher,
                 into: memoryview, *, reuse: bool) -> None:
    """Read ``nbytes`` from ``offset``, hashing each chunk as it lands: into consecutive
    slices of ``into`` (a storage, ``nbytes`` long), or with ``reuse`` through its
    start over and over (the scratch buffer)."""
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
        hasher.update(view)
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
