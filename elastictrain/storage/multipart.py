"""Streaming multipart upload to S3: ``torch.save`` writes straight into upload parts.

The serialised state never exists as one buffer. Bytes are copied once, from the
staged tensors into a part buffer; a full part is handed to one of
``concurrency`` upload threads and a fresh buffer is started, so memory depends
on the settings, never on the state's size.

The first part is ``single_put_max`` bytes: a stream that ends within it is sent
as one ``PutObject``, like s3fs and boto3 do for small objects (one request
instead of three; servers that re-hash every part on completion, moto among
them, are markedly slower on multipart). Later parts are ``part_size``. The
HTTP client (aiohttp) copies a part once more while sending it, so one upload
holds at most about ``2 * (single_put_max + concurrency * part_size)`` bytes.

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

import contextvars
import enum
import io
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from elastictrain.errors import StorageError
from elastictrain.log import get_logger

Call = Callable[[str, Callable[[], Any]], Any]

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
            failures into :class:`~elastictrain.errors.StorageError`.
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
        self._buf: io.BytesIO | None = None
        self._fill = 0
        self._size = 0  # capacity of the current part buffer
        self._upload_id: str | None = None
        self._next_part = 1
        self._etags: dict[int, str] = {}
        self._pending: set[Future[tuple[int, str]]] = set()
        self._pool: ThreadPoolExecutor | None = None
        self.state = UploadState.OPEN
        self.bytes_written = 0

    # -- the stream side (torch.save calls these) -------------------------------------
    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.bytes_written

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = view.nbytes
        while view.nbytes:
            if self._buf is not None and self._fill == self._size:
                # Sent only once more bytes come: a stream of exactly one part is one PUT.
                self._send_part()
            if self._buf is None:
                # A BytesIO grows by realloc (no copy for large buffers) and getvalue()
                # hands over its own bytes object: filling it copies each byte once.
                self._buf, self._size = io.BytesIO(), self._current_part_size()
            take = min(self._size - self._fill, view.nbytes)
            self._buf.write(view[:take])
            self._fill += take
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

    def _take_buffer(self) -> bytes:
        if self._buf is None:
            return b""
        self._buf.truncate(self._fill)  # a short last part
        # getvalue() hands over the buffer's own bytes object (no copy): bytes, not a
        # bytearray, because aiohttp copies a bytearray body twice while sending it.
        body = self._buf.getvalue()
        self._buf, self._fill, self._size = None, 0, 0
        return body

    def _send_part(self) -> None:
        if self._upload_id is None:
            created = self._call("start multipart upload of", lambda: self._s3(
                "create_multipart_upload", Bucket=self._bucket, Key=self._key))
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

    def _upload_part(self, number: int, body: bytes) -> tuple[int, str]:
        out = self._call(f"upload part {number} of", lambda: self._s3(
            "upload_part", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id,
            PartNumber=number, Body=body))
        return number, str(out["ETag"])

    def _collect(self, below: int) -> None:
        """Wait until fewer than ``below`` parts are in flight; re-raise the first failure."""
        while len(self._pending) >= max(below, 1):
            done, _ = wait(self._pending, return_when=FIRST_COMPLETED)
            for future in done:
                self._pending.discard(future)
                number, etag = future.result()
                self._etags[number] = etag

    def _s3(self, method: str, **kwargs: Any) -> Any:
        return self._fs.call_s3(method, **kwargs)

    # -- ending -----------------------------------------------------------------------
    def commit(self) -> None:
        """Make the object appear: one PUT if it fit in one part, else complete the upload."""
        if self._upload_id is None:
            body = self._take_buffer()
            self._call("write", lambda: self._s3(
                "put_object", Bucket=self._bucket, Key=self._key, Body=body))
        else:
            if self._fill:
                self._send_part()
            self._collect(below=1)
            parts = [{"PartNumber": n, "ETag": e} for n, e in sorted(self._etags.items())]
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
            log.info("storage.upload_aborted", path=self._where, parts=len(self._etags),
                     reason=reason)
        except Exception as exc:
            log.warning("storage.upload_abort_failed", path=self._where,
                        error_type=type(exc).__name__, reason=reason)

    def _release(self) -> None:
        self._buf = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def close(self) -> None:
        """Closing without ``commit`` abandons the upload (nothing appears)."""
        if self.state is UploadState.OPEN:
            self.abort("closed without commit")
        super().close()

