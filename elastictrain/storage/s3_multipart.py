"""Streaming multipart upload to S3: ``torch.save`` writes straight into upload parts.

The serialised state never exists as one buffer, and the staged tensors are not
copied at all: the caller names the memory that stays unchanged until the upload
is committed (:meth:`MultipartWriter.keep_references_to`, the staged slabs), and
a write that lies in it is kept as a ``memoryview`` of that memory. Only what
``torch.save`` builds on the fly (zip headers, the pickle) is copied, into
exact-size pieces (:class:`PartBuffer`). A full part is handed to one of
``concurrency`` upload threads and a fresh one is started; with nothing named,
every write is copied once and memory is bounded by the settings, never by the
state's size.

The first part is ``single_put_max`` bytes: a stream that ends within it is sent
as one ``PutObject``, like s3fs and boto3 do for small objects: one request
instead of three, and servers that re-hash every part on completion are slower
on multipart (docs/performance.md). Later parts are ``part_size``; so is the
first where the kept memory alone exceeds ``single_put_max`` (the upload is
known to be multipart before the first byte). Each
request body is a :class:`RequestBody` over the part's pieces, which aiohttp
sends as 1 MiB ``memoryview`` slices: given plain ``bytes`` it would join the
headers and the whole body into a second copy (and Python 3.11's socket
transport copies what the kernel did not take at once a third time). Where the
client sends CRC32 checksums (botocore's default), each part's is computed here
with ISA-L, in the upload thread, and sent with it: botocore would compute the
same on the event loop that every upload shares, with zlib, several times slower.
The upload then names CRC32 when it starts and every part's checksum when it
completes: the object's checksum is the composite of the parts' (docs/storage.md).

Lifecycle (``UploadState``)::

    open ──write──▶ open ──commit──▶ committed   (object appears, atomically)
      │                   └─failure─▶ aborted     (AbortMultipartUpload; no object)
      └──────abort──────────────────▶ aborted

S3 shows an object only when ``CompleteMultipartUpload`` (or the single PUT)
succeeds, so a failed or abandoned upload never leaves a partial object. If
even the abort cannot reach the store, the parts linger invisibly until a
bucket lifecycle rule (``AbortIncompleteMultipartUpload``) removes them.
"""

from __future__ import annotations

import base64
import bisect
import contextvars
import enum
import io
import zlib
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from elastictrain.core.errors import StorageError
from elastictrain.core.log import get_logger

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # a platform without an isal build
    _crc32 = zlib.crc32

Call = Callable[[str, Callable[[], Any]], Any]
Piece = bytes | bytearray | memoryview

log = get_logger("elastictrain.storage")

MAX_PARTS = 10_000  # S3's limit per upload
_GROW_EVERY = 1_000  # double the part size every 1000 parts: 16 MiB parts reach ~16 TiB


class UploadState(str, enum.Enum):
    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"


class MultipartWriter(io.RawIOBase):
    """A write-only stream that uploads ``path`` to S3 in parts as bytes arrive.

    Args:
        fs: an ``s3fs.S3FileSystem``; requests go through its ``call_s3`` so its
            ``s3_additional_kwargs`` (server-side encryption…) apply to every part.
        path: ``bucket/key`` of the object.
        part_size: bytes per part after the first (the last may be smaller);
            at least 5 MiB on S3.
        concurrency: parts uploaded at the same time.
        where: how events name the object (its redacted URL); default ``path``.
        single_put_max: size of the first part, and so the largest object sent as
            one PUT (default: ``part_size``). Stores that need equal parts
            (s3fs ``fixed_upload_size``, e.g. Cloudflare R2) use ``part_size``.
        call: ``call(op, fn)`` runs ``fn`` with the store's retries and turns
            failures into :class:`~elastictrain.core.errors.StorageError`.
    """

    def __init__(self, fs: Any, path: str, *, part_size: int, concurrency: int,
                 call: Call, single_put_max: int | None = None,
                 where: str | None = None) -> None:
        super().__init__()
        self._fs = fs
        self._path = path
        self._where = where or path
        self._bucket, self._key, _ = fs.split_path(path)
        self._part_size = part_size
        self._grow = not getattr(fs, "fixed_upload_size", False)  # R2 needs equal parts
        self._first_part_size = single_put_max if single_put_max and self._grow else part_size
        self._concurrency = concurrency
        self._call = call
        self._buf: PartBuffer | None = None
        self._size = 0  # capacity of the current part buffer
        self._upload_id: str | None = None
        self._next_part = 1
        # Each uploaded part as CompleteMultipartUpload lists it: number, ETag, and its
        # CRC32 where checksums are sent (named at the start, S3 wants them again).
        self._parts: dict[int, dict[str, Any]] = {}
        self._pending: set[Future[dict[str, Any]]] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._kept = KeptMemory()
        self._send_crc: bool | None = None  # whether the client sends checksums; known later
        self.state = UploadState.OPEN
        self.bytes_written = 0

    def keep_references_to(self, buffers: Iterable[Any]) -> None:
        """Keep writes that lie in ``buffers`` (contiguous, CPU memory) as views of them
        instead of copying them. The caller keeps these buffers alive and unchanged
        until the upload is committed or aborted: a part is read when it is sent."""
        self._kept.add(buffers)
        if self._kept.nbytes > self._first_part_size and self._next_part == 1:
            # Known to be a multipart upload already: no single-PUT-sized first part,
            # every part the same size, and the first one starts sooner.
            self._first_part_size = self._part_size

    # -- the stream side (torch.save calls these) -------------------------------------
    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.bytes_written

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = view.nbytes
        while view.nbytes:
            if self._buf is not None and self._buf.nbytes == self._size:
                # Sent only once more bytes come: a stream of exactly one part is one PUT.
                self._send_part()
            if self._buf is None:
                self._buf, self._size = PartBuffer(self._kept), self._current_part_size()
            take = min(self._size - self._buf.nbytes, view.nbytes)
            self._buf.append(view[:take])
            view = view[take:]
        self.bytes_written += total
        return total

    # -- parts ----------------------------------------------------------------------------
    def _current_part_size(self) -> int:
        if self._next_part == 1:
            return self._first_part_size
        if not self._grow:
            return self._part_size
        return self._part_size * 2 ** ((self._next_part - 1) // _GROW_EVERY)

    def _take_buffer(self) -> PartBuffer:
        body = self._buf if self._buf is not None else PartBuffer(self._kept)
        self._buf, self._size = None, 0
        return body

    def _send_part(self) -> None:
        if self._upload_id is None:
            # Naming the parts' algorithm makes the object's checksum a composite of
            # the parts' (which the store checks as each part arrives), as boto3's
            # transfer manager does; without it a store computes a whole-object
            # checksum at completion (moto copies the whole object to do so).
            algorithm = {"ChecksumAlgorithm": "CRC32"} if self._sends_crc() else {}
            created = self._call("start multipart upload of", lambda: self._s3(
                "create_multipart_upload", Bucket=self._bucket, Key=self._key, **algorithm))
            self._upload_id = str(created["UploadId"])
            self._pool = ThreadPoolExecutor(self._concurrency, thread_name_prefix="et-upload")
        if self._next_part > MAX_PARTS:
            raise StorageError(f"write {self._where}: more than {MAX_PARTS} parts; fix: raise "
                               "storage.part_size_bytes")
        self._collect(below=self._concurrency)  # back-pressure: bounded parts in memory
        number, body = self._next_part, self._take_buffer()
        self._next_part += 1
        assert self._pool is not None
        # Run in the caller's context: events from upload threads keep run_id, rank, step.
        context = contextvars.copy_context()
        self._pending.add(self._pool.submit(context.run, self._upload_part, number, body))

    def _upload_part(self, number: int, body: PartBuffer) -> dict[str, Any]:
        checksum = self._checksum_of(body)  # once, not per attempt
        out = self._call(f"upload part {number} of", lambda: self._s3(
            "upload_part", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id,
            PartNumber=number, Body=RequestBody(body.pieces), **checksum))
        return {"PartNumber": number, "ETag": str(out["ETag"]), **checksum}

    def _sends_crc(self) -> bool:
        """Whether the client sends CRC32 checksums (botocore's default,
        ``request_checksum_calculation="when_supported"``); not where it would not (a
        store that rejects checksums is configured ``when_required``)."""
        if self._send_crc is None:
            config = getattr(getattr(getattr(self._fs, "s3", None), "meta", None), "config",
                             None)
            self._send_crc = (getattr(config, "request_checksum_calculation", None)
                              == "when_supported")
        return self._send_crc

    def _checksum_of(self, body: PartBuffer) -> dict[str, str]:
        """The request's CRC32 header where the client sends checksums, else nothing."""
        if not self._sends_crc():
            return {}
        return {"ChecksumCRC32": RequestBody(body.pieces).crc32_base64()}

    def _collect(self, below: int) -> None:
        """Wait until fewer than ``below`` parts are in flight; re-raise the first failure."""
        while len(self._pending) >= max(below, 1):
            done, _ = wait(self._pending, return_when=FIRST_COMPLETED)
            for future in done:
                self._pending.discard(future)
                part = future.result()
                self._parts[part["PartNumber"]] = part

    def _s3(self, method: str, **kwargs: Any) -> Any:
        return self._fs.call_s3(method, **kwargs)

    # -- ending -----------------------------------------------------------------------
    def commit(self) -> None:
        """Make the object appear: one PUT if it fit in one part, else complete the upload."""
        if self._upload_id is None:
            body = self._take_buffer()
            checksum = self._checksum_of(body)
            self._call("write", lambda: self._s3(
                "put_object", Bucket=self._bucket, Key=self._key,
                Body=RequestBody(body.pieces), **checksum))
        else:
            if self._buf is not None and self._buf.nbytes:
                self._send_part()
            self._collect(below=1)
            parts = [self._parts[n] for n in sorted(self._parts)]
            self._call("complete multipart upload of", lambda: self._s3(
                "complete_multipart_upload", Bucket=self._bucket, Key=self._key,
                UploadId=self._upload_id, MultipartUpload={"Parts": parts}))
        self.state = UploadState.COMMITTED
        self._release()
        self._fs.invalidate_cache(self._path)

    def abort(self, reason: str = "") -> None:
        """Drop the upload: cancel queued parts and abort it on the store (best effort)."""
        if self.state is not UploadState.OPEN:
            return
        self.state = UploadState.ABORTED
        for future in self._pending:
            future.cancel()
        wait(self._pending)
        self._pending.clear()
        self._release()
        if self._upload_id is None:
            return
        try:
            # One attempt: after an outage the store is likely still down, and the
            # parts are invisible anyway; a lifecycle rule reclaims them.
            self._s3("abort_multipart_upload", Bucket=self._bucket, Key=self._key,
                     UploadId=self._upload_id)
            log.info("storage.upload_aborted", path=self._where, parts=len(self._parts),
                     reason=reason)
        except Exception as exc:
            log.warning("storage.upload_abort_failed", path=self._where,
                        error_type=type(exc).__name__, reason=reason)

    def _release(self) -> None:
        self._buf = None
        self._kept = KeptMemory()  # the caller's buffers may change from here on
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def close(self) -> None:
        """Closing without ``commit`` abandons the upload (nothing appears)."""
        if self.state is UploadState.OPEN:
            self.abort("closed without commit")
        super().close()


class KeptMemory:
    """Memory the caller keeps unchanged until the upload ends: a write that lies in it
    is kept as a view of it (no copy). Found by address: ``torch.save`` hands each
    storage over as a ``memoryview`` of the storage's own memory, but a view that only
    lives during the call; the kept view is of the caller's buffer, which outlives it."""

    def __init__(self) -> None:
        self._starts: list[int] = []  # addresses, ascending
        self._views: list[memoryview] = []
        self.nbytes = 0

    def add(self, buffers: Iterable[Any]) -> None:
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            if not view.nbytes:
                continue
            start = _address(view)
            index = bisect.bisect_left(self._starts, start)
            self._starts.insert(index, start)
            self._views.insert(index, view)
            self.nbytes += view.nbytes

    def find(self, view: memoryview) -> tuple[int, int, int] | None:
        """(buffer index, start, end) of ``view`` within a kept buffer, or None."""
        if not self._starts:
            return None
        address = _address(view)
        index = bisect.bisect_right(self._starts, address) - 1
        if index < 0:
            return None
        start = address - self._starts[index]
        end = start + view.nbytes
        return (index, start, end) if end <= self._views[index].nbytes else None

    def view(self, index: int, start: int, end: int) -> memoryview:
        return self._views[index][start:end]


def _address(view: memoryview) -> int:
    """Where a (C-contiguous, possibly read-only) buffer's bytes start in memory."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class PartBuffer:
    """One part's bytes, held as pieces of exact size: views of kept memory (no copy,
    :class:`KeptMemory`), and copies of the rest, each byte copied in once and nothing
    over-allocated (a growing ``BytesIO`` reserves up to 1/8 more than it holds, and
    joining pieces would make a second copy).

    Writes of at least ``_OWN_PIECE`` bytes (the tensors) become pieces of their
    own, a view where they lie in kept memory (consecutive writes of one buffer are
    one piece); smaller ones (pickle records, zip headers) are gathered into shared
    pieces of up to ``_SMALL_PIECE`` bytes, so a part is a few hundred pieces,
    not one per record.
    """

    _OWN_PIECE = 64 << 10
    _SMALL_PIECE = 1 << 20

    def __init__(self, kept: KeptMemory | None = None) -> None:
        self.pieces: list[Piece] = []
        self.nbytes = 0
        self.copied_bytes = 0
        self._kept = kept or KeptMemory()
        self._small: bytearray | None = None
        self._last_kept: tuple[int, int, int] | None = None  # the last piece, if a view

    def append(self, view: memoryview) -> None:
        if view.nbytes >= self._OWN_PIECE:
            self._small = None  # keep the pieces in order
            span = self._kept.find(view)
            if span is None:
                self.pieces.append(view.tobytes())
                self.copied_bytes += view.nbytes
                self._last_kept = None
            elif self._last_kept is not None and self._last_kept[0] == span[0] \
                    and self._last_kept[2] == span[1]:  # continues the last piece
                index, start, _ = self._last_kept
                self.pieces[-1] = self._kept.view(index, start, span[2])
                self._last_kept = (index, start, span[2])
            else:
                self.pieces.append(self._kept.view(*span))
                self._last_kept = span
        else:
            if self._small is None or len(self._small) + view.nbytes > self._SMALL_PIECE:
                self._small = bytearray()
                self.pieces.append(self._small)
                self._last_kept = None
            self._small += view
            self.copied_bytes += view.nbytes
        self.nbytes += view.nbytes


class RequestBody:
    """One request's body over a part's pieces, sent without copying them whole.

    botocore reads it as a file (``read``/``seek``/``tell``) to sign and checksum
    it, then seeks back; aiohttp sends it as an async iterable of ``memoryview``
    slices of at most ``piece_bytes`` (a slice the kernel does not take at once is
    all Python 3.11's socket transport copies). Not an ``io.IOBase``: aiohttp would
    then read it 256 KiB at a time through a thread pool, and a ``bytes`` or
    ``BytesIO`` body is copied whole (joined with the headers; ``BytesIO.getbuffer``
    unshares it). Every send is the whole body (see ``_pieces``).
    """

    def __init__(self, pieces: Sequence[Piece], piece_bytes: int = 1 << 20) -> None:
        self._views = [memoryview(p).cast("B") for p in pieces if len(p)]
        self._starts: list[int] = []
        total = 0
        for view in self._views:
            self._starts.append(total)
            total += view.nbytes
        self._total = total
        self._piece = piece_bytes
        self._pos = 0

    def __len__(self) -> int:
        return self._total

    def crc32_base64(self) -> str:
        """The body's CRC32 as S3's ``x-amz-checksum-crc32`` header carries it."""
        value = 0
        for view in self._views:
            value = _crc32(view, value)
        return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._total}[whence]
        self._pos = min(max(base + offset, 0), self._total)
        return self._pos

    def _slices(self, end: int, most: int) -> Iterator[memoryview]:
        """Views of the bytes from the current position to ``end``, each at most
        ``most`` long, advancing the position."""
        index = bisect.bisect_right(self._starts, self._pos) - 1
        while self._pos < end:
            view, start = self._views[index], self._starts[index]
            stop = min(end, start + view.nbytes, self._pos + most)
            piece = view[self._pos - start:stop - start]
            self._pos = stop
            if stop == start + view.nbytes:
                index += 1
            yield piece

    def read(self, n: int | None = -1) -> bytes:
        end = self._total if n is None or n < 0 else min(self._pos + n, self._total)
        return b"".join(self._slices(end, end))

    async def _pieces(self) -> AsyncIterator[memoryview]:
        # Always the whole body, and the file position untouched: s3fs retries a throttled
        # request with this same object, and botocore signs and checksums it again from
        # the file position. Were sending to move it, the retry would announce the full
        # Content-Length and send nothing (the server waits for the body forever).
        for view in self._views:
            for start in range(0, view.nbytes, self._piece):
                yield view[start:start + self._piece]

    def __aiter__(self) -> AsyncIterator[memoryview]:
        return self._pieces()
