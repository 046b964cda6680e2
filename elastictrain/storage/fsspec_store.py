"""An fsspec-backed :class:`~elastictrain.storage.api.Store`.

Local paths (and ``file://``) get real atomicity: whole objects are written to
a temporary name, fsynced and renamed, and directories are committed by
rename. Object stores (``s3://``, ``memory://``) have no rename, so callers
write payload objects first and the commit marker last, in one PUT; where the
backend enforces ``If-None-Match``, the marker is created only if absent.

Listings always invalidate fsspec's directory cache first: s3fs caches them
indefinitely by default, which is how a resume can pick an old step.

On S3, ``open_write`` streams a multipart upload (:mod:`.multipart`), transient
faults are retried with backoff (:mod:`.retry`), and the faults a user must fix
get a message naming the bucket and the fix (:mod:`.s3`). No message ever
carries a credential: URLs are redacted and storage options are never echoed.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
import re
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar, cast

import fsspec
import fsspec.asyn
from fsspec.implementations.local import LocalFileSystem

from elastictrain.errors import (
    ConfigError,
    ObjectSizeMismatch,
    StorageConflictError,
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
    StorageTransientError,
)
from elastictrain.localfiles import make_private_dirs, private_opener
from elastictrain.log import get_logger
from elastictrain.storage import s3
from elastictrain.storage.api import Store
from elastictrain.storage.faults import with_faults
from elastictrain.storage.multipart import MultipartWriter
from elastictrain.storage.retry import RetryPolicy, is_transient

if TYPE_CHECKING:
    from elastictrain.config import StorageConfig

T = TypeVar("T")

log = get_logger("elastictrain.storage")

DEFAULT_MULTIPART_THRESHOLD = 64 * 2**20
DEFAULT_PART_SIZE = 16 * 2**20
DEFAULT_UPLOAD_CONCURRENCY = 4
READ_BLOCK = 2**20
_CREDENTIALS_IN_URL = re.compile(r"(?<=://)[^/@]+@")
_INSTALL_HINT = {"s3": "s3fs (pip install 'elastictrain[s3]')", "gs": "gcsfs", "az": "adlfs"}


def redact_url(url: str) -> str:
    """Drop ``user:secret@`` from a URL so it can be logged."""
    return _CREDENTIALS_IN_URL.sub("", url)


def refuse_credentials_in_url(url: str) -> None:
    """Raise ConfigError for ``scheme://user:secret@…``: fsspec backends do not take
    credentials from a URL (s3fs would send them as part of the bucket name, and the
    backend's errors would echo them), so they are refused before any request."""
    if _CREDENTIALS_IN_URL.search(url):
        raise ConfigError(
            f"storage URL {redact_url(url)!r} has credentials in it (user:secret@, removed "
            "here); fix: remove them from the URL and pass them as storage_options "
            "key/secret (--storage-options or ELASTICTRAIN_STORAGE__STORAGE_OPTIONS) or "
            "through the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE)"
        )


class FsspecStore:
    """A Store over any fsspec file system. See the module docstring for the guarantees.

    Args:
        url: a local path, ``file://``, ``memory://``, ``s3://bucket/prefix``…
        storage_options: passed straight to fsspec (``key``/``secret``/``token``,
            ``profile``, ``anon``, ``client_kwargs={"endpoint_url": …}``,
            ``config_kwargs``…); fsspec's own ``FSSPEC_S3_*`` configuration fills in
            what is not given here. Never logged.
        retries, retry_backoff_s: the operation-level retry policy (:mod:`.retry`).
        multipart_threshold_bytes, part_size_bytes, upload_concurrency: streaming
            uploads on S3 (:mod:`.multipart`): objects up to the threshold go in one
            PUT, larger ones as multipart uploads.
        private: local files created ``0600`` and directories ``0700``.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        retries: int = 5,
        retry_backoff_s: float = 0.2,
        part_size_bytes: int = DEFAULT_PART_SIZE,
        upload_concurrency: int = DEFAULT_UPLOAD_CONCURRENCY,
        multipart_threshold_bytes: int | None = None,
        private: bool = False,
    ) -> None:
        refuse_credentials_in_url(url)
        self._url = url
        # Local files only this user may read (0600 files, 0700 directories): the
        # node-memory tier (elastictrain/localfiles.py).
        self._private = private
        self._policy = RetryPolicy(retries=retries, backoff_s=retry_backoff_s)
        self._part_size = part_size_bytes
        self._threshold = (DEFAULT_MULTIPART_THRESHOLD if multipart_threshold_bytes is None
                           else multipart_threshold_bytes)
        self._concurrency = upload_concurrency
        try:
            fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except ImportError as exc:
            scheme = url.split("://", 1)[0]
            hint = _INSTALL_HINT.get(scheme, f"the fsspec backend for {scheme}://")
            raise StorageError(
                f"storage URL {self._url!r} needs {hint}; fix: install it"
            ) from None if "s3fs" in str(exc) else exc
        except (ValueError, TypeError) as exc:
            # The message may quote an option's value: never show it (it may be a secret).
            raise StorageError(
                f"cannot open storage URL {self._url!r} ({type(exc).__name__}); fix: check "
                "the URL and the names and types in storage_options"
            ) from None
        self.fs = fs
        self.is_local = isinstance(fs, LocalFileSystem)
        self.is_s3 = s3.is_s3_protocol(fs.protocol)
        self.root = os.path.abspath(root) if self.is_local else root.rstrip("/")
        self.bucket = self.root.split("/", 1)[0] if self.is_s3 else ""
        self._conditional_put = self.is_local or self.is_s3 or "memory" in _protocols(fs)

    # -- properties ---------------------------------------------------------------
    @property
    def url(self) -> str:
        return self._url

    @property
    def supports_rename(self) -> bool:
        return self.is_local

    @property
    def supports_conditional_put(self) -> bool:
        return self._conditional_put

    def _full(self, path: str) -> str:
        return f"{self.root}/{path}".rstrip("/") if path else self.root

    def _describe(self, path: str) -> str:
        return f"{self._url.rstrip('/')}/{path}" if path else self._url

    # -- error translation and retries ------------------------------------------
    def _call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        try:
            result, _ = self._policy.run(fn, op=op, where=self._describe(path))
        except Exception as exc:
            raise self._translate(op, path, exc, getattr(exc, "retries_used", 0)) from exc
        return result

    def _translate(self, op: str, path: str, exc: Exception, attempts: int) -> StorageError:
        where = self._describe(path)
        if isinstance(exc, StorageError):
            return exc
        if self.is_s3:
            specific = s3.translate(op, where, self.bucket, exc)
            if specific is not None:
                return specific
        if isinstance(exc, FileNotFoundError):
            return StorageNotFoundError(
                f"{op} {where}: not found; fix: check the storage URL, and that the bucket "
                "or directory exists"
            )
        if isinstance(exc, PermissionError):
            return StoragePermissionError(
                f"{op} {where}: permission denied; fix: grant write access or choose "
                "another --storage location, and check the credentials in use"
            )
        if isinstance(exc, FileExistsError):
            return StorageConflictError(
                f"{op} {where}: already exists (another writer committed it)")
        if is_transient(exc):
            return StorageTransientError(
                f"{op} {where}: still failing after {attempts} retries "
                f"({type(exc).__name__}); fix: check that the storage endpoint is reachable"
            )
        reason = redact_url(str(exc)) or type(exc).__name__
        return StorageError(f"{op} {where}: {reason}")

    # -- writes -------------------------------------------------------------------
    def write_bytes(self, path: str, data: bytes, *, if_absent: bool = False) -> None:
        full = self._full(path)
        if self.is_local:
            self._call("write", path, lambda: _local_atomic_write(full, data, if_absent,
                                                                   self._private))
            return
        if if_absent and self._conditional_put:
            try:
                self._call("write", path, lambda: self.fs.pipe_file(full, data, mode="create"))
                return
            except StorageConflictError:
                raise
            except StorageError as exc:
                if not (self.is_s3 and s3.is_conditional_unsupported(exc)):
                    raise
                # An S3-compatible store without If-None-Match: check, then write.
                self._conditional_put = False
                log.warning("storage.conditional_put_unsupported", url=self._url,
                            fallback="exists check before PUT (not atomic)")
        if if_absent and self._call("stat", path, lambda: self._exists(full)):
            raise StorageConflictError(
                f"write {self._describe(path)}: already exists (another writer committed it)")
        self._call("write", path, lambda: self.fs.pipe_file(full, data))

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        if self.is_local:
            with self._open_write_local(path) as f:
                yield f
        elif self.is_s3:
            with self._open_write_s3(path) as f:
                yield f
        else:
            with self._open_write_fsspec(path) as f:
                yield f

    @contextmanager
    def _open_write_local(self, path: str) -> Iterator[BinaryIO]:
        full = self._full(path)
        tmp = f"{full}.tmp-{uuid.uuid4().hex}"
        try:
            _make_dirs(os.path.dirname(full), self._private)
            with open(tmp, "wb", opener=_opener(self._private)) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, full)  # appears whole or not at all
            _fsync_dir(os.path.dirname(full))
        except OSError as exc:
            raise self._translate("write", path, exc, 0) from exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @contextmanager
    def _open_write_s3(self, path: str) -> Iterator[BinaryIO]:
        writer = MultipartWriter(
            self.fs, self._full(path), part_size=self._part_size,
            concurrency=self._concurrency, single_put_max=self._threshold,
            call=lambda op, fn: self._call(op, path, fn), where=self._describe(path))
        try:
            yield cast(BinaryIO, writer)
            writer.commit()
        except BaseException as exc:
            writer.abort(type(exc).__name__)
            if isinstance(exc, OSError):  # the backend's; the caller's own errors pass
                raise self._translate("write", path, exc, 0) from exc
            raise

    @contextmanager
    def _open_write_fsspec(self, path: str) -> Iterator[BinaryIO]:
        full = self._full(path)
        f = self._call("write", path, lambda: self.fs.open(full, "wb"))
        try:
            yield f
            f.close()
        except BaseException as exc:
            # Some backends (memory://) show the object while it is written: remove it.
            getattr(f, "discard", lambda: None)()
            self._delete_quietly(full)
            if isinstance(exc, OSError):  # the backend's; the caller's own errors pass
                raise self._translate("write", path, exc, 0) from exc
            raise

    # -- reads ---------------------------------------------------------------------
    def read_bytes(self, path: str) -> bytes:
        full = self._full(path)
        if self.is_s3:
            return bytes(self._call("read", path, lambda: self._cat_s3(full)))
        return bytes(self._call("read", path, lambda: self.fs.cat_file(full)))

    def _cat_s3(self, full: str) -> bytes:
        """A whole object in one GET. s3fs's whole-object read asks for the size first (a
        HEAD, to choose concurrent ranges); a read from byte 0 on is the same bytes
        without it: one round trip less for every manifest a restore reads."""
        try:
            return bytes(self.fs.cat_file(full, start=0))
        except OSError as exc:
            if s3.error_code(exc) != "InvalidRange":
                raise
            return bytes(self.fs.cat_file(full))  # an empty object: S3 refuses any range

    @contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        full = self._full(path)
        # A small read-ahead block: a streamed read then holds ~1 MiB plus the read
        # in progress, not fsspec's default block (50 MiB on S3). docs/restore.md.
        f = self._call("read", path, lambda: self.fs.open(full, "rb", block_size=READ_BLOCK))
        try:
            yield f
        except StorageError:
            raise
        except Exception as exc:
            # Only a failed read is a storage error. The caller's own work on the bytes
            # (torch.load, a missing numpy, a shape check) raised inside this block
            # keeps its type: wrapped, it read as a storage fault and hid the cause.
            if not _is_io_error(exc):
                raise
            raise self._translate("read", path, exc, 0) from exc
        finally:
            f.close()

    def read_into(self, path: str, buffer: Any, offset: int = 0, *,
                  object_size: int | None = None) -> int:
        view = memoryview(buffer).cast("B")
        if view.readonly:
            raise ValueError(f"read_into {self._describe(path)}: the buffer is read-only")
        if self.is_s3:
            self._read_ranges_s3(path, view, offset, object_size)
            return view.nbytes
        if object_size is not None:
            self._check_size(path, object_size)
        self._call("read", path, lambda: self._read_stream_into(path, view, offset))
        return view.nbytes

    def _check_size(self, path: str, expected: int) -> None:
        actual = self.size(path)
        if actual != expected:
            raise self._size_mismatch(path, expected, actual)

    def _size_mismatch(self, path: str, expected: int, actual: int) -> ObjectSizeMismatch:
        return ObjectSizeMismatch(f"read {self._describe(path)}: the object is {actual} bytes, "
                                  f"{expected} expected", actual)

    def _read_stream_into(self, path: str, view: memoryview, offset: int) -> None:
        with self.fs.open(self._full(path), "rb") as f:
            f.seek(offset)
            filled = 0
            while filled < view.nbytes:
                got = f.readinto(view[filled:])
                if not got:
                    raise self._short_read(path, offset, view.nbytes, filled)
                filled += got

    def _range_bytes(self, object_bytes: int, wanted: int) -> int:
        """Bytes per ranged GET. An object up to the multipart threshold is read in one
        GET, as boto3 does (one request; a server that reads the whole object for every
        range, moto among them, pays once). A larger one is read as ``upload_concurrency``
        ranges of at least ``part_size_bytes``: each streams into its slice of the
        buffer, so the range size no longer bounds memory and fewer, larger ranges save
        requests."""
        if object_bytes <= self._threshold:
            return max(wanted, 1)
        return max(self._part_size, -(-wanted // self._concurrency))

    def _read_ranges_s3(self, path: str, view: memoryview, offset: int,
                        object_size: int | None) -> None:
        """Ranged GETs, ``upload_concurrency`` at a time, each streamed straight into
        its slice of ``view`` as the bytes arrive (no whole-range ``bytes``). Every
        answer carries the object's size (``Content-Range``): checked against
        ``object_size`` at no extra request."""
        full = self._full(path)
        bucket, key, version = self.fs.split_path(full)
        if not view.nbytes:
            if object_size is not None:
                self._check_size(path, object_size)
            return
        span = self._range_bytes(offset + view.nbytes if object_size is None else object_size,
                                 view.nbytes)

        def fetch(start: int) -> None:
            end = min(start + span, view.nbytes)
            try:
                got, total = self._call("read", path, lambda: fsspec.asyn.sync(
                    self.fs.loop, self._get_into, bucket, key, version, view[start:end],
                    offset + start))
            except StorageNotFoundError:
                raise
            except StorageError:
                # A range past the end of a shorter object is refused (416): one HEAD,
                # on this error path only, tells a short object from a failed read.
                if object_size is not None:
                    self._check_size(path, object_size)
                raise
            if total < 0:
                raise StorageError(f"read {self._describe(path)}: the store ignored the Range "
                                   "header; fix: use an S3-compatible store that serves ranges")
            if object_size is not None and total != object_size:
                raise self._size_mismatch(path, object_size, total)
            if got != end - start:
                raise self._short_read(path, offset, view.nbytes, start + got)

        starts = range(0, view.nbytes, span)
        if len(starts) == 1:
            fetch(0)
            return
        pending_starts = iter(starts)
        context = contextvars.copy_context()  # events from readers keep run_id, rank, step
        with ThreadPoolExecutor(self._concurrency, thread_name_prefix="et-read") as pool:
            pending = {pool.submit(context.copy().run, fetch, s)
                       for s in itertools.islice(pending_starts, self._concurrency)}
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

    def _short_read(self, path: str, offset: int, wanted: int, got: int) -> StorageError:
        return StorageError(
            f"read {self._describe(path)}: the object ends after {offset + got} bytes, "
            f"{offset + wanted} expected; fix: the object changed or was truncated: check "
            "the snapshots with `elastictrain snapshots verify`")

    def list_dir(self, path: str) -> list[str]:
        full = self._full(path)

        def ls() -> list[str]:
            # s3fs caches listings forever by default: always ask the store itself.
            self.fs.invalidate_cache(full)
            try:
                entries = self.fs.ls(full, detail=False, refresh=True)
            except FileNotFoundError as exc:
                if s3.is_missing_bucket(exc):
                    raise  # not "no snapshots yet": the location itself is wrong
                return []
            prefix = full.rstrip("/") + "/"
            names = [str(e).rstrip("/") for e in entries]
            return sorted(n[len(prefix):] if n.startswith(prefix) else n.rsplit("/", 1)[-1]
                          for n in names if n.rstrip("/") != full.rstrip("/"))

        return self._call("list", path, ls)

    def _exists(self, full: str) -> bool:
        # Not ``fs.exists``: fsspec's default answers False for *any* error, and a
        # throttled or denied check must not read as "absent" (retention would
        # then delete a committed snapshot as a partial write).
        self.fs.invalidate_cache(full)
        try:
            self.fs.info(full)
        except FileNotFoundError as exc:
            if s3.is_missing_bucket(exc):
                raise  # not "absent": the location itself is wrong
            return False
        return True

    def exists(self, path: str) -> bool:
        full = self._full(path)
        return self._call("stat", path, lambda: self._exists(full))

    def size(self, path: str) -> int:
        full = self._full(path)
        self.fs.invalidate_cache(full)
        return int(self._call("stat", path, lambda: self.fs.size(full)))

    # -- deletes and moves ---------------------------------------------------------
    def delete(self, path: str, *, recursive: bool = False) -> None:
        full = self._full(path)

        def rm() -> None:
            try:
                self.fs.rm(full, recursive=recursive)
            except FileNotFoundError as exc:
                if s3.is_missing_bucket(exc):
                    raise
            self.fs.invalidate_cache(full)

        self._call("delete", path, rm)

    def _delete_quietly(self, full: str) -> None:
        # Nothing there, or unreachable: either way there is nothing to report.
        with contextlib.suppress(Exception):
            self.fs.rm(full)

    def rename(self, src: str, dst: str) -> None:
        if not self.is_local:
            raise StorageError(f"rename in {self._url}: the store has no atomic rename")
        full_src, full_dst = self._full(src), self._full(dst)

        def mv() -> None:
            os.rename(full_src, full_dst)
            _fsync_dir(os.path.dirname(full_dst))

        self._call("rename", dst, mv)

    def local_path(self, path: str) -> str | None:
        return self._full(path) if self.is_local else None

    def check_writable(self) -> None:
        probe = f".elastictrain-probe-{uuid.uuid4().hex}"
        if self.is_local:
            self._call("create", "", lambda: os.makedirs(self.root, exist_ok=True))
        self.write_bytes(probe, b"ok")
        self.delete(probe)

    def __repr__(self) -> str:
        return f"FsspecStore({self._url!r})"


def open_store(
    target: str | StorageConfig,
    storage_options: dict[str, Any] | None = None,
    retries: int = 5,
    retry_backoff_s: float = 0.2,
) -> Store:
    """Open a Store for a URL (a local path, ``file://``, ``memory://``, ``s3://``…) or
    for a :class:`~elastictrain.config.StorageConfig` (all of its settings apply;
    ``storage_options``, if given, update the config's; ``faults`` wraps the store in
    :class:`~elastictrain.storage.faults.FaultyStore`)."""
    if isinstance(target, str):
        return FsspecStore(target, storage_options, retries=retries,
                           retry_backoff_s=retry_backoff_s)
    store = FsspecStore(
        target.url, {**target.storage_options, **(storage_options or {})},
        retries=target.retries, retry_backoff_s=target.retry_backoff_s,
        part_size_bytes=target.part_size_bytes, upload_concurrency=target.upload_concurrency,
        multipart_threshold_bytes=target.multipart_threshold_bytes,
    )
    return with_faults(store, target.faults)


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def _make_dirs(directory: str, private: bool) -> None:
    if private:
        make_private_dirs(Path(directory))
    else:
        os.makedirs(directory, exist_ok=True)


def _opener(private: bool) -> Callable[[str, int], int] | None:
    return private_opener if private else None


def _local_atomic_write(full: str, data: bytes, if_absent: bool, private: bool) -> None:
    directory = os.path.dirname(full)
    _make_dirs(directory, private)
    tmp = f"{full}.tmp-{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb", opener=_opener(private)) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if if_absent:
            os.link(tmp, full)  # fails with FileExistsError if another writer won
        else:
            os.replace(tmp, full)
        _fsync_dir(directory)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_io_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed read or write: an ``OSError`` (fsspec and s3fs raise
    those, timeouts and dropped connections included) or an S3/HTTP client error that
    s3fs let through (``s3`` knows them by code or class name)."""
    return (isinstance(exc, OSError) or s3.error_code(exc) is not None
            or s3.is_transient(exc) is not None)
