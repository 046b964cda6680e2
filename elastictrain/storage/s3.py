"""The S3 backend (``s3://``, ``s3a://``; AWS, MinIO, Ceph, R2…) through s3fs.

What S3 does differently from the generic backend:

* **faults**: S3 error codes decide what is retried and what the user is told
  (:mod:`.s3_errors`);
* **streamed writes** are multipart uploads (:mod:`.s3_multipart`): an object
  appears only when the upload completes, so a failed write leaves nothing;
* **create-only writes** send ``If-None-Match: *``; a store that does not
  implement it falls back to a check before the PUT (not atomic), with a warning;
* **whole-object reads** are one GET: s3fs's whole-object read asks for the size
  first (a HEAD, to choose concurrent ranges); a read from byte 0 on is the same
  bytes without it, one round trip less for every manifest a restore reads;
* **reads into a buffer** are parallel ranged GETs, each streamed into its slice
  of the buffer as the bytes arrive; every answer carries the object's size
  (``Content-Range``), so the expected size is checked at no extra request;
* a "not found" naming the bucket means the location is wrong, not that
  nothing was written yet.
"""

from __future__ import annotations

import contextvars
import itertools
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import BinaryIO, cast

import fsspec.asyn

from elastictrain.core.errors import StorageError, StorageNotFoundError
from elastictrain.storage import s3_errors
from elastictrain.storage.generic import Backend
from elastictrain.storage.s3_multipart import MultipartWriter


class S3Backend(Backend):
    """S3 and S3-compatible stores; see the module docstring for what differs."""

    CONDITIONAL_PUT = True

    @property
    def bucket(self) -> str:
        return self.root.split("/", 1)[0]

    # -- faults -----------------------------------------------------------------------
    @classmethod
    def is_transient(cls, exc: BaseException) -> bool:
        verdict = s3_errors.is_transient(exc)
        return super().is_transient(exc) if verdict is None else verdict

    @classmethod
    def error_code(cls, exc: BaseException) -> str | None:
        return s3_errors.error_code(exc)

    @classmethod
    def is_io_error(cls, exc: BaseException) -> bool:
        # s3fs lets some botocore errors through unwrapped: known by code or class name.
        return super().is_io_error(exc) or s3_errors.is_transient(exc) is not None

    @classmethod
    def is_missing_location(cls, exc: FileNotFoundError) -> bool:
        return s3_errors.is_missing_bucket(exc)

    @classmethod
    def is_conditional_unsupported(cls, exc: StorageError) -> bool:
        return s3_errors.is_conditional_unsupported(exc)

    def explain(self, op: str, where: str, exc: BaseException) -> StorageError | None:
        return s3_errors.translate(op, where, self.bucket, exc)

    # -- writes -----------------------------------------------------------------------
    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        writer = MultipartWriter(
            self.fs, self.full(path), part_size=self.settings.part_size_bytes,
            concurrency=self.settings.upload_concurrency,
            single_put_max=self.settings.multipart_threshold_bytes,
            call=lambda op, fn: self.call(op, path, fn), where=self.describe(path))
        try:
            yield cast(BinaryIO, writer)
            writer.commit()
        except BaseException as exc:
            writer.abort(type(exc).__name__)
            if isinstance(exc, OSError):  # the backend's; the caller's own errors pass
                raise self.translate("write", path, exc, 0) from exc
            raise

    # -- reads ------------------------------------------------------------------------
    def cat(self, full: str) -> bytes:
        try:
            return bytes(self.fs.cat_file(full, start=0))
        except OSError as exc:
            if s3_errors.error_code(exc) != "InvalidRange":
                raise
            return bytes(self.fs.cat_file(full))  # an empty object: S3 refuses any range

    def range_bytes(self, object_bytes: int, wanted: int) -> int:
        """Bytes per ranged GET. An object up to the multipart threshold is read in one
        GET, as boto3 does: one request, and a server that reads the whole object for
        every range reads it once. A larger one is read as ``upload_concurrency`` ranges
        of at least ``part_size_bytes``: each streams into its slice of the buffer, so
        the range size does not bound memory, and fewer, larger ranges save requests."""
        if object_bytes <= self.settings.multipart_threshold_bytes:
            return max(wanted, 1)
        return max(self.settings.part_size_bytes,
                   -(-wanted // self.settings.upload_concurrency))

    def read_into(self, path: str, view: memoryview, offset: int,
                  object_size: int | None) -> None:
        """Ranged GETs, ``upload_concurrency`` at a time, each streamed straight into
        its slice of ``view`` (no whole-range ``bytes``), the object's size checked
        against ``object_size`` from each answer's ``Content-Range``."""
        bucket, key, version = self.fs.split_path(self.full(path))
        if not view.nbytes:
            if object_size is not None:
                self.check_size(path, object_size)
            return
        span = self.range_bytes(offset + view.nbytes if object_size is None else object_size,
                                view.nbytes)

        def fetch(start: int) -> None:
            end = min(start + span, view.nbytes)
            try:
                got, total = self.call("read", path, lambda: fsspec.asyn.sync(
                    self.fs.loop, self._get_into, bucket, key, version, view[start:end],
                    offset + start))
            except StorageNotFoundError:
                raise
            except StorageError:
                # A range past the end of a shorter object is refused (416): one HEAD,
                # on this error path only, tells a short object from a failed read.
                if object_size is not None:
                    self.check_size(path, object_size)
                raise
            if total < 0:
                raise StorageError(f"read {self.describe(path)}: the store ignored the Range "
                                   "header; fix: use an S3-compatible store that serves ranges")
            if object_size is not None and total != object_size:
                raise self.size_mismatch(path, object_size, total)
            if got != end - start:
                raise self.short_read(path, offset, view.nbytes, start + got)

        starts = range(0, view.nbytes, span)
        if len(starts) == 1:
            fetch(0)
            return
        self._run_concurrently(fetch, starts)

    def _run_concurrently(self, fetch: Callable[[int], None], starts: range) -> None:
        """``fetch(start)`` for every start, ``upload_concurrency`` at a time; the first
        failure cancels what has not started and is raised."""
        concurrency = self.settings.upload_concurrency
        pending_starts = iter(starts)
        context = contextvars.copy_context()  # events from readers keep run_id, rank, step
        with ThreadPoolExecutor(concurrency, thread_name_prefix="et-read") as pool:
            pending = {pool.submit(context.copy().run, fetch, s)
                       for s in itertools.islice(pending_starts, concurrency)}
            try:
                while pending:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        future.result()
                        for start in itertools.islice(pending_starts, 1):
                            pending.add(pool.submit(context.copy().run, fetch, start))
            except BaseException:
                for future in pending:
                    future.cancel()
                raise

    async def _get_into(self, bucket: str, key: str, version: str | None, view: memoryview,
                        start: int) -> tuple[int, int]:
        """GET bytes ``start`` to ``start + len(view)`` of an object into ``view`` as they
        arrive, in s3fs's event loop (its client, retries and error translation);
        returns (bytes received, the object's size)."""
        resp = await self.fs._call_s3(
            "get_object", Bucket=bucket, Key=key,
            Range=f"bytes={start}-{start + view.nbytes - 1}",
            **({"VersionId": version} if version else {}))
        body = resp["Body"]
        try:
            got = 0
            while got < view.nbytes:
                n = await body.readinto(view[got:])
                if not n:
                    break
                got += n
        finally:
            body.close()
        content_range = resp.get("ContentRange")  # "bytes 0-99/1234"
        if content_range:
            return got, int(str(content_range).rsplit("/", 1)[1])
        # No Range honoured: the whole object came, which is only right from byte 0.
        return got, int(resp["ContentLength"]) if start == 0 else -1
