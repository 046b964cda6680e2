"""The backend for any fsspec file system, and the base the other backends refine.

A backend is what a store does that depends on its protocol: how objects are
written and read, which faults are worth retrying, and what a user is told about
the ones that are not. :mod:`.backends` picks one by protocol. This one serves
every protocol without a backend of its own (``memory://``, ``gs://``, ``az://``…)
with fsspec's own calls, and holds the fault rules true of any store: ``OSError``
kinds and errno values, and dropped connections of the HTTP client under fsspec's
remote file systems (aiohttp). Google Cloud Storage and Azure need nothing more.

Object stores have no rename, so callers write payload objects first and the
commit marker last, in one PUT; where the backend enforces ``If-None-Match``
(:attr:`Backend.CONDITIONAL_PUT`), the marker is created only if absent.

Listings and existence checks always invalidate fsspec's directory cache first:
s3fs caches listings indefinitely by default, which is how a resume could pick an
old step. No message carries a credential: URLs are redacted and storage options
are never echoed.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, TypeVar

from elastictrain.core.errors import (
    ObjectSizeMismatch,
    StorageConflictError,
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
    StorageTransientError,
)
from elastictrain.core.log import get_logger
from elastictrain.storage.urls import redact_url

if TYPE_CHECKING:
    from elastictrain.storage.retry import RetryPolicy

T = TypeVar("T")

log = get_logger("elastictrain.storage")

# A small read-ahead block: a streamed read then holds ~1 MiB plus the read in
# progress, not fsspec's default block (50 MiB on S3). docs/restore.md.
READ_BLOCK = 2**20

_TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET,
                               errno.ECONNREFUSED, errno.EBUSY, errno.EREMOTEIO})
_PERMANENT = (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError,
              NotADirectoryError)
# Dropped connections by class name (no imports): aiohttp's, and any ``ConnectionError``
# (Python's, or a client library's of that name that does not derive from it).
_DROPPED_CONNECTIONS = frozenset({
    "ConnectionError", "ClientConnectorError", "ServerDisconnectedError", "ClientOSError",
    "ClientPayloadError", "ServerTimeoutError",
})


def cause_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what caused it: fsspec backends wrap a client's error in an ``OSError``."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 16:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _is_dropped_connection(exc: BaseException) -> bool:
    return any(type(link).__name__ in _DROPPED_CONNECTIONS for link in cause_chain(exc))


@dataclass(frozen=True)
class StoreSettings:
    """How a store moves bytes (from :class:`~elastictrain.core.config.StorageConfig`).

    Attributes:
        part_size_bytes, upload_concurrency, multipart_threshold_bytes: uploads and
            ranged reads on S3 (:mod:`.s3`).
        private: local files created ``0600`` and directories ``0700`` (:mod:`.local`).
    """

    part_size_bytes: int
    upload_concurrency: int
    multipart_threshold_bytes: int
    private: bool = False


class Backend:
    """Any fsspec file system; subclasses override what their protocol does differently.

    Args:
        fs: the fsspec file system.
        root: the root within ``fs`` (``bucket/prefix``, a directory…).
        url: the store's URL, for messages (credentials already refused).
        policy: retries of each operation (:mod:`.retry`).
        settings: transfer settings.
    """

    CONDITIONAL_PUT: ClassVar[bool] = False  # create-only writes enforced by the store
    SUPPORTS_RENAME: ClassVar[bool] = False  # an atomic rename of directories

    def __init__(self, fs: Any, root: str, url: str, policy: RetryPolicy,
                 settings: StoreSettings) -> None:
        self.fs = fs
        self.root = self.normalise_root(root)
        self.url = url
        self.policy = policy
        self.settings = settings
        # May turn False on a store that turns out not to enforce it (:mod:`.s3`).
        self.conditional_put = self.CONDITIONAL_PUT

    @staticmethod
    def normalise_root(root: str) -> str:
        return root.rstrip("/")

    # -- paths ------------------------------------------------------------------------
    def full(self, path: str) -> str:
        return f"{self.root}/{path}".rstrip("/") if path else self.root

    def describe(self, path: str) -> str:
        return f"{self.url.rstrip('/')}/{path}" if path else self.url

    # -- faults: which are transient, and what the user is told ----------------------
    @classmethod
    def is_transient(cls, exc: BaseException) -> bool:
        """Whether retrying the operation that raised ``exc`` can succeed."""
        if _is_dropped_connection(exc):
            return True
        if isinstance(exc, _PERMANENT):
            return False
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return True
        return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS

    @classmethod
    def error_code(cls, exc: BaseException) -> str | None:
        """The store's own name for the fault (an S3 error code), for events."""
        return None

    @classmethod
    def is_io_error(cls, exc: BaseException) -> bool:
        """Whether ``exc`` is a failed read or write: an ``OSError`` (fsspec raises those,
        timeouts included) or a client's error that the file system let through."""
        return isinstance(exc, OSError) or _is_dropped_connection(exc)

    @classmethod
    def is_missing_location(cls, exc: FileNotFoundError) -> bool:
        """Whether a "not found" means the store's location itself is missing (no bucket),
        not just the object: a listing or existence check then raises, not answers."""
        return False

    @classmethod
    def is_conditional_unsupported(cls, exc: StorageError) -> bool:
        """Whether a create-only write failed because the store does not support it."""
        return False

    def explain(self, op: str, where: str, exc: BaseException) -> StorageError | None:
        """A protocol's own message for a fault users can fix; None for the generic one."""
        return None

    def call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        """``fn()`` with retries; a failure raised as a :class:`StorageError`."""
        try:
            result, _ = self.policy.run(fn, op=op, where=self.describe(path),
                                        transient=self.is_transient,
                                        error_code=self.error_code)
        except Exception as exc:
            raise self.translate(op, path, exc, getattr(exc, "retries_used", 0)) from exc
        return result

    def translate(self, op: str, path: str, exc: Exception, attempts: int) -> StorageError:
        if isinstance(exc, StorageError):
            return exc
        where = self.describe(path)
        specific = self.explain(op, where, exc)
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
        if self.is_transient(exc):
            return StorageTransientError(
                f"{op} {where}: still failing after {attempts} retries "
                f"({type(exc).__name__}); fix: check that the storage endpoint is reachable"
            )
        reason = redact_url(str(exc)) or type(exc).__name__
        return StorageError(f"{op} {where}: {reason}")

    # -- writes -----------------------------------------------------------------------
    def write_bytes(self, path: str, data: bytes, *, if_absent: bool) -> None:
        full = self.full(path)
        if if_absent and self.conditional_put:
            try:
                self.call("write", path, lambda: self.fs.pipe_file(full, data, mode="create"))
                return
            except StorageConflictError:
                raise
            except StorageError as exc:
                if not self.is_conditional_unsupported(exc):
                    raise
                self.conditional_put = False
                log.warning("storage.conditional_put_unsupported", url=self.url,
                            fallback="exists check before PUT (not atomic)")
        if if_absent and self.exists(path):
            raise StorageConflictError(
                f"write {self.describe(path)}: already exists (another writer committed it)")
        self.call("write", path, lambda: self.fs.pipe_file(full, data))

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        full = self.full(path)
        f = self.call("write", path, lambda: self.fs.open(full, "wb"))
        try:
            yield f
            f.close()
        except BaseException as exc:
            # Some backends (memory://) show the object while it is written: remove it.
            getattr(f, "discard", lambda: None)()
            self._delete_quietly(full)
            if isinstance(exc, OSError):  # the backend's; the caller's own errors pass
                raise self.translate("write", path, exc, 0) from exc
            raise

    # -- reads ------------------------------------------------------------------------
    def read_bytes(self, path: str) -> bytes:
        full = self.full(path)
        return bytes(self.call("read", path, lambda: self.cat(full)))

    def cat(self, full: str) -> bytes:
        """A whole object's bytes (one attempt; :meth:`read_bytes` retries)."""
        return bytes(self.fs.cat_file(full))

    @contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        full = self.full(path)
        f = self.call("read", path, lambda: self.fs.open(full, "rb", block_size=READ_BLOCK))
        try:
            yield f
        except StorageError:
            raise
        except Exception as exc:
            # Only a failed read is a storage error. The caller's own work on the bytes
            # (torch.load, a missing numpy, a shape check) raised inside this block keeps
            # its type, so its cause stays visible.
            if not self.is_io_error(exc):
                raise
            raise self.translate("read", path, exc, 0) from exc
        finally:
            f.close()

    def read_into(self, path: str, view: memoryview, offset: int,
                  object_size: int | None) -> None:
        """Fill ``view`` with the object's bytes from ``offset`` on (see Store.read_into)."""
        if object_size is not None:
            self.check_size(path, object_size)
        self.call("read", path, lambda: self._read_stream_into(path, view, offset))

    def _read_stream_into(self, path: str, view: memoryview, offset: int) -> None:
        with self.fs.open(self.full(path), "rb") as f:
            f.seek(offset)
            filled = 0
            while filled < view.nbytes:
                got = f.readinto(view[filled:])
                if not got:
                    raise self.short_read(path, offset, view.nbytes, filled)
                filled += got

    def check_size(self, path: str, expected: int) -> None:
        actual = self.size(path)
        if actual != expected:
            raise self.size_mismatch(path, expected, actual)

    def size_mismatch(self, path: str, expected: int, actual: int) -> ObjectSizeMismatch:
        return ObjectSizeMismatch(f"read {self.describe(path)}: the object is {actual} bytes, "
                                  f"{expected} expected", actual)

    def short_read(self, path: str, offset: int, wanted: int, got: int) -> StorageError:
        return StorageError(
            f"read {self.describe(path)}: the object ends after {offset + got} bytes, "
            f"{offset + wanted} expected; fix: the object changed or was truncated: check "
            "the snapshots with `elastictrain snapshots verify`")

    # -- listings and checks ----------------------------------------------------------
    def list_dir(self, path: str) -> list[str]:
        full = self.full(path)

        def ls() -> list[str]:
            self.fs.invalidate_cache(full)
            try:
                entries = self.fs.ls(full, detail=False, refresh=True)
            except FileNotFoundError as exc:
                if self.is_missing_location(exc):
                    raise  # not "no snapshots yet": the location itself is wrong
                return []
            prefix = full.rstrip("/") + "/"
            names = [str(e).rstrip("/") for e in entries]
            return sorted(n[len(prefix):] if n.startswith(prefix) else n.rsplit("/", 1)[-1]
                          for n in names if n.rstrip("/") != full.rstrip("/"))

        return self.call("list", path, ls)

    def exists(self, path: str) -> bool:
        full = self.full(path)
        return self.call("stat", path, lambda: self._exists(full))

    def _exists(self, full: str) -> bool:
        # Not ``fs.exists``: fsspec's default answers False for *any* error, and a
        # throttled or denied check must not read as "absent" (retention would
        # then delete a committed snapshot as a partial write).
        self.fs.invalidate_cache(full)
        try:
            self.fs.info(full)
        except FileNotFoundError as exc:
            if self.is_missing_location(exc):
                raise  # not "absent": the location itself is wrong
            return False
        return True

    def size(self, path: str) -> int:
        full = self.full(path)
        self.fs.invalidate_cache(full)
        return int(self.call("stat", path, lambda: self.fs.size(full)))

    # -- deletes and moves ------------------------------------------------------------
    def delete(self, path: str, *, recursive: bool) -> None:
        full = self.full(path)

        def rm() -> None:
            try:
                self.fs.rm(full, recursive=recursive)
            except FileNotFoundError as exc:
                if self.is_missing_location(exc):
                    raise
            self.fs.invalidate_cache(full)

        self.call("delete", path, rm)

    def _delete_quietly(self, full: str) -> None:
        # Nothing there, or unreachable: either way there is nothing to report.
        with contextlib.suppress(Exception):
            self.fs.rm(full)

    def rename(self, src: str, dst: str) -> None:
        raise StorageError(f"rename in {self.url}: the store has no atomic rename")

    def local_path(self, path: str) -> str | None:
        return None

    def prepare_root(self) -> None:
        """Create the root where the store needs it before a first write."""


class MemoryBackend(Backend):
    """``memory://`` (tests, demos): fsspec's in-memory file system honours create-only
    writes."""

    CONDITIONAL_PUT = True
