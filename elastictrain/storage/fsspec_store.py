"""An fsspec-backed :class:`~elastictrain.storage.api.Store`.

Local paths (and ``file://``) get real atomicity: whole objects are written to
a temporary name, fsynced and renamed, and directories are committed by
rename. Object stores (``s3://``, ``memory://``) have no rename, so callers
write payload objects first and the commit marker last, in one PUT; where the
backend enforces ``If-None-Match``, the marker is created only if absent.

Listings always invalidate fsspec's directory cache first: s3fs caches them
indefinitely by default, which is how a resume can pick an old step.
"""

from __future__ import annotations

import errno
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, BinaryIO, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from elastictrain.errors import (
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
    StorageTransientError,
)

T = TypeVar("T")

_TRANSIENT_ERRNOS = {errno.EIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.EBUSY}
_CREDENTIALS_IN_URL = re.compile(r"(?<=://)[^/@]+@")
_INSTALL_HINT = {"s3": "s3fs (pip install 'elastictrain[s3]')", "gs": "gcsfs", "az": "adlfs"}


def redact_url(url: str) -> str:
    """Drop ``user:secret@`` from a URL so it can be logged."""
    return _CREDENTIALS_IN_URL.sub("", url)


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    name = type(exc).__name__
    return name in {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                    "ClientConnectorError", "ServerDisconnectedError", "ClientOSError",
                    "ResponseStreamingError"}


class FsspecStore:
    """A Store over any fsspec file system. See the module docstring for the guarantees."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        retries: int = 5,
        retry_backoff_s: float = 0.2,
    ) -> None:
        self._url = redact_url(url)
        self._retries = retries
        self._backoff = retry_backoff_s
        try:
            fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except ImportError as exc:
            scheme = url.split("://", 1)[0]
            hint = _INSTALL_HINT.get(scheme, f"the fsspec backend for {scheme}://")
            raise StorageError(
                f"storage URL {self._url!r} needs {hint}; fix: install it"
            ) from None if "s3fs" in str(exc) else exc
        except (ValueError, TypeError) as exc:
            raise StorageError(
                f"cannot open storage URL {self._url!r}: {exc}; fix: check the URL and "
                "storage_options"
            ) from None
        self.fs = fs
        self.is_local = isinstance(fs, LocalFileSystem)
        self.root = os.path.abspath(root) if self.is_local else root.rstrip("/")

    # -- properties ---------------------------------------------------------------
    @property
    def url(self) -> str:
        return self._url

    @property
    def supports_rename(self) -> bool:
        return self.is_local

    @property
    def supports_conditional_put(self) -> bool:
        return self.is_local or "s3" in _protocols(self.fs)

    def _full(self, path: str) -> str:
        return f"{self.root}/{path}".rstrip("/") if path else self.root

    def _describe(self, path: str) -> str:
        return f"{self._url.rstrip('/')}/{path}" if path else self._url

    # -- error translation and retries ------------------------------------------
    def _call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        attempt = 0
        while True:
            try:
                return fn()
            except Exception as exc:
                if _is_transient(exc) and attempt < self._retries:
                    time.sleep(self._backoff * (2**attempt))
                    attempt += 1
                    continue
                raise self._translate(op, path, exc, attempt) from exc

    def _translate(self, op: str, path: str, exc: Exception, attempts: int) -> StorageError:
        where = self._describe(path)
        if isinstance(exc, StorageError):
            return exc
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
            return StorageError(f"{op} {where}: already exists (another writer committed it)")
        if _is_transient(exc):
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
            self._call("write", path, lambda: _local_atomic_write(full, data, if_absent))
            return
        mode = "create" if if_absent and self.supports_conditional_put else "overwrite"
        if if_absent and mode == "overwrite" and self._call("stat", path,
                                                            lambda: self.fs.exists(full)):
            raise StorageError(f"write {self._describe(path)}: already exists")
        self._call("write", path, lambda: self.fs.pipe_file(full, data, mode=mode))

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        full = self._full(path)
        if self.is_local:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            try:
                f = open(full, "wb")  # noqa: SIM115 - closed below after fsync
            except OSError as exc:
                raise self._translate("write", path, exc, 0) from exc
            try:
                yield f
                f.flush()
                os.fsync(f.fileno())
            except OSError as exc:
                raise self._translate("write", path, exc, 0) from exc
            finally:
                f.close()
            return
        try:
            with self.fs.open(full, "wb") as f:
                yield f
        except StorageError:
            raise
        except Exception as exc:
            raise self._translate("write", path, exc, 0) from exc

    # -- reads ---------------------------------------------------------------------
    def read_bytes(self, path: str) -> bytes:
        full = self._full(path)
        return bytes(self._call("read", path, lambda: self.fs.cat_file(full)))

    @contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        full = self._full(path)
        f = self._call("read", path, lambda: self.fs.open(full, "rb"))
        try:
            yield f
        except StorageError:
            raise
        except Exception as exc:
            raise self._translate("read", path, exc, 0) from exc
        finally:
            f.close()

    def list_dir(self, path: str) -> list[str]:
        full = self._full(path)

        def ls() -> list[str]:
            self.fs.invalidate_cache(full)
            try:
                entries = self.fs.ls(full, detail=False, refresh=True)
            except FileNotFoundError:
                return []
            prefix = full.rstrip("/") + "/"
            names = [str(e).rstrip("/") for e in entries]
            return sorted(n[len(prefix):] if n.startswith(prefix) else n.rsplit("/", 1)[-1]
                          for n in names if n.rstrip("/") != full.rstrip("/"))

        return self._call("list", path, ls)

    def exists(self, path: str) -> bool:
        full = self._full(path)
        self.fs.invalidate_cache(full)
        return bool(self._call("stat", path, lambda: self.fs.exists(full)))

    def size(self, path: str) -> int:
        full = self._full(path)
        self.fs.invalidate_cache(full)
        return int(self._call("stat", path, lambda: self.fs.size(full)))

    # -- deletes and moves ---------------------------------------------------------
    def delete(self, path: str, *, recursive: bool = False) -> None:
        full = self._full(path)

        def rm() -> None:
            with suppress(FileNotFoundError):
                self.fs.rm(full, recursive=recursive)
            self.fs.invalidate_cache(full)

        self._call("delete", path, rm)

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
    url: str,
    storage_options: dict[str, Any] | None = None,
    retries: int = 5,
    retry_backoff_s: float = 0.2,
) -> FsspecStore:
    """Open a Store for ``url`` (a local path, ``file://``, ``memory://``, ``s3://``…)."""
    return FsspecStore(url, storage_options, retries=retries, retry_backoff_s=retry_backoff_s)


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def _local_atomic_write(full: str, data: bytes, if_absent: bool) -> None:
    directory = os.path.dirname(full)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{full}.tmp-{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
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
