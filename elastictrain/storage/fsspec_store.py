"""The :class:`~elastictrain.storage.api.Store` over fsspec, and :func:`open_store`.

:class:`FsspecStore` opens a URL with fsspec and hands every operation to the
backend for its protocol (:mod:`.backends`): :mod:`.local` for local paths,
:mod:`.s3` for S3, :mod:`.generic` for the rest. Every operation is retried by
the store's :class:`~elastictrain.storage.retry.RetryPolicy` while its backend
calls the fault transient, then raised as an :mod:`elastictrain.core.errors` storage
error with a fix, never with a credential.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, BinaryIO

import fsspec

from elastictrain.core.errors import StorageError
from elastictrain.storage.api import Store
from elastictrain.storage.backends import backend_for
from elastictrain.storage.faults import with_faults
from elastictrain.storage.generic import StoreSettings
from elastictrain.storage.retry import RetryPolicy
from elastictrain.storage.urls import refuse_credentials_in_url, refuse_misspelled_scheme

if TYPE_CHECKING:
    from elastictrain.core.config import StorageConfig

DEFAULT_MULTIPART_THRESHOLD = 64 * 2**20
DEFAULT_PART_SIZE = 16 * 2**20
DEFAULT_UPLOAD_CONCURRENCY = 4
_INSTALL_HINT = {"s3": "s3fs (pip install 'elastictrain[s3]')", "gs": "gcsfs", "az": "adlfs"}


class FsspecStore:
    """A Store over any fsspec file system; its backend does what the protocol needs.

    Args:
        url: a local path, ``file://``, ``memory://``, ``s3://bucket/prefix``…
        storage_options: passed straight to fsspec (``key``/``secret``/``token``,
            ``profile``, ``anon``, ``client_kwargs={"endpoint_url": …}``,
            ``config_kwargs``…); fsspec's own ``FSSPEC_S3_*`` configuration fills in
            what is not given here. Never logged.
        retries, retry_backoff_s: the operation-level retry policy (:mod:`.retry`).
        multipart_threshold_bytes, part_size_bytes, upload_concurrency: streaming
            uploads and ranged reads on S3 (:mod:`.s3`): objects up to the threshold
            go in one PUT, larger ones as multipart uploads.
        private: local files created ``0600`` and directories ``0700``.
        retry_sleep: what waits between tries (``time.sleep``; a test's own clock).
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
        *, private: bool = False,
        retry_sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        refuse_credentials_in_url(url)
        refuse_misspelled_scheme(url)
        self._url = url
        self._policy = RetryPolicy.for_storage(retries, retry_backoff_s, retry_sleep)
        settings = StoreSettings(
            part_size_bytes=part_size_bytes, upload_concurrency=upload_concurrency,
            multipart_threshold_bytes=(DEFAULT_MULTIPART_THRESHOLD
                                       if multipart_threshold_bytes is None
                                       else multipart_threshold_bytes),
            private=private)
        fs, root = _open_fs(url, storage_options)
        self.fs = fs
        self.backend = backend_for(fs.protocol)(fs, root, url, self._policy, settings)
        self.root = self.backend.root

    # -- properties -------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self._url

    @property
    def supports_rename(self) -> bool:
        return self.backend.SUPPORTS_RENAME

    @property
    def supports_conditional_put(self) -> bool:
        return self.backend.conditional_put

    def _full(self, path: str) -> str:
        return self.backend.full(path)

    # -- Store ------------------------------------------------------------------------
    def write_bytes(self, path: str, data: bytes, *, if_absent: bool = False) -> None:
        self.backend.write_bytes(path, data, if_absent=if_absent)

    def open_write(self, path: str) -> AbstractContextManager[BinaryIO]:
        return self.backend.open_write(path)

    def read_bytes(self, path: str) -> bytes:
        return self.backend.read_bytes(path)

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        return self.backend.open_read(path)

    def read_into(self, path: str, buffer: Any, offset: int = 0, *,
                  object_size: int | None = None) -> int:
        view = memoryview(buffer).cast("B")
        if view.readonly:
            raise ValueError(f"read_into {self.backend.describe(path)}: the buffer is "
                             "read-only")
        self.backend.read_into(path, view, offset, object_size)
        return view.nbytes

    def list_dir(self, path: str) -> list[str]:
        return self.backend.list_dir(path)

    def exists(self, path: str) -> bool:
        return self.backend.exists(path)

    def size(self, path: str) -> int:
        return self.backend.size(path)

    def delete(self, path: str, *, recursive: bool = False) -> None:
        self.backend.delete(path, recursive=recursive)

    def rename(self, src: str, dst: str) -> None:
        self.backend.rename(src, dst)

    def local_path(self, path: str) -> str | None:
        return self.backend.local_path(path)

    def check_writable(self) -> None:
        probe = f".elastictrain-probe-{uuid.uuid4().hex}"
        self.backend.prepare_root()
        self.write_bytes(probe, b"ok")
        self.delete(probe)

    def __repr__(self) -> str:
        return f"FsspecStore({self._url!r})"


def _open_fs(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """fsspec's file system and root for ``url``; a missing backend package or a bad
    option is a StorageError naming the fix (never an option's value: it may be secret)."""
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:
        scheme = url.split("://", 1)[0]
        hint = _INSTALL_HINT.get(scheme, f"the fsspec backend for {scheme}://")
        raise StorageError(
            f"storage URL {url!r} needs {hint}; fix: install it"
        ) from None if "s3fs" in str(exc) else exc
    except (ValueError, TypeError) as exc:
        raise StorageError(
            f"cannot open storage URL {url!r} ({type(exc).__name__}); fix: check "
            "the URL and the names and types in storage_options"
        ) from None
    return fs, str(root)


def open_store(
    target: str | StorageConfig,
    storage_options: dict[str, Any] | None = None,
    retries: int = 5,
    retry_backoff_s: float = 0.2,
) -> Store:
    """Open a Store for a URL (a local path, ``file://``, ``memory://``, ``s3://``…) or
    for a :class:`~elastictrain.core.config.StorageConfig` (all of its settings apply;
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
