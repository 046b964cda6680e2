"""Checksums of payload objects, computed while bytes stream past.

crc32 is the default and the algorithm is named in every manifest: it is a
small part of a persist or a restore and releases the GIL on large buffers.
ISA-L's identical CRC-32 (``isal``, a dependency) is used; zlib's, several
times slower, only where isal cannot be installed. Figures: docs/storage.md.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import BinaryIO, Protocol

from elastictrain.core.config import ChecksumAlgorithm

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # a platform without an isal build
    _crc32 = zlib.crc32


class Hasher(Protocol):
    def update(self, data: bytes | memoryview) -> None: ...
    def hexdigest(self) -> str: ...


class _Crc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | memoryview) -> None:
        self._value = _crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def new_hasher(algorithm: ChecksumAlgorithm) -> Hasher:
    if algorithm == "crc32":
        return _Crc32()
    return hashlib.sha256()


def checksum_bytes(data: bytes | memoryview, algorithm: ChecksumAlgorithm) -> str:
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


class HashingWriter:
    """A write-only file wrapper that counts and hashes what it forwards.

    Large writes (``torch.save`` hands over a whole storage at once) are cut
    into ``chunk_bytes`` pieces, each hashed and then written, so the sink sees
    a steady stream (and can start writing back early) instead of one huge
    write after one huge checksum pass.
    """

    def __init__(self, sink: BinaryIO, algorithm: ChecksumAlgorithm,
                 chunk_bytes: int = 16 << 20) -> None:
        self._sink = sink
        self._hasher = new_hasher(algorithm)
        self._chunk = chunk_bytes
        self.bytes_written = 0

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, self._chunk):
            piece = view[start:start + self._chunk]
            self._hasher.update(piece)
            self._sink.write(piece)
        self.bytes_written += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._sink.flush()

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()
