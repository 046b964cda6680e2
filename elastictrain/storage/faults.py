"""A Store wrapper that injects storage faults on purpose, for ``elastictrain chaos``.

Switched on by configuration (``[storage.faults]`` in TOML or
``ELASTICTRAIN_STORAGE__FAULTS__*``), never by editing a training script:
:func:`~elastictrain.storage.fsspec_store.open_store` wraps its store when
faults are configured. Each injected fault logs ``storage.fault_injected``.

Faults, each independent:

* ``read_error_p`` / ``write_error_p``: an operation fails with
  :class:`~elastictrain.core.errors.StorageTransientError`, as a store does once its
  own retries are used up (reads: read, list, stat; writes: write, delete, rename);
* ``latency_s``: every operation waits this long first;
* ``crash_after_bytes``: the first ``crash_writes`` payload writes of each
  process fail after that many bytes, mid-upload (the inner store then discards
  the partial object as it would after any failed write).

Draws come from a private generator seeded by ``seed`` and the process id, so the
training script's random streams are never touched.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, BinaryIO, cast

from elastictrain.core import layout
from elastictrain.core.config import FaultsConfig
from elastictrain.core.errors import StorageTransientError
from elastictrain.core.log import get_logger
from elastictrain.storage.api import Store

log = get_logger("elastictrain.storage")

_READS = ("read", "list", "stat")


def with_faults(store: Store, faults: FaultsConfig | None) -> Store:
    """``store`` itself, or wrapped in a :class:`FaultyStore` when ``faults`` is set."""
    return store if faults is None else FaultyStore(store, faults)


class FaultyStore:
    """Forwards every Store call to ``inner``, injecting the faults of ``config``."""

    def __init__(self, inner: Store, config: FaultsConfig) -> None:
        self.inner = inner
        self.config = config
        self._rng = random.Random(f"{config.seed}:{os.getpid()}")
        self._crashes_left = config.crash_writes if config.crash_after_bytes is not None else 0

    # -- the fault decision -------------------------------------------------------
    def _maybe_fail(self, op: str, path: str) -> None:
        if self.config.latency_s:
            time.sleep(self.config.latency_s)  # injected latency, not synchronisation
        p = self.config.read_error_p if op in _READS else self.config.write_error_p
        if p and self._rng.random() < p:
            log.warning("storage.fault_injected", fault="error", op=op, path=path)
            raise StorageTransientError(
                f"{op} {self.inner.url.rstrip('/')}/{path}: injected fault "
                "(storage.faults is set); fix: unset ELASTICTRAIN_STORAGE__FAULTS__*")

    # -- Store protocol -----------------------------------------------------------
    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def supports_rename(self) -> bool:
        return self.inner.supports_rename

    @property
    def supports_conditional_put(self) -> bool:
        return self.inner.supports_conditional_put

    def write_bytes(self, path: str, data: bytes, *, if_absent: bool = False) -> None:
        self._maybe_fail("write", path)
        self.inner.write_bytes(path, data, if_absent=if_absent)

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        self._maybe_fail("write", path)
        crash = (self._crashes_left > 0 and layout.is_payload(path.rsplit("/", 1)[-1])
                 and self.config.crash_after_bytes is not None)
        with self.inner.open_write(path) as sink:
            if not crash:
                yield sink
                return
            self._crashes_left -= 1
            assert self.config.crash_after_bytes is not None
            yield cast(BinaryIO, _CrashingSink(sink, self.config.crash_after_bytes,
                                               self.inner.url, path))

    def read_bytes(self, path: str) -> bytes:
        self._maybe_fail("read", path)
        return self.inner.read_bytes(path)

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        self._maybe_fail("read", path)
        return self.inner.open_read(path)

    def read_into(self, path: str, buffer: Any, offset: int = 0, *,
                  object_size: int | None = None) -> int:
        self._maybe_fail("read", path)
        return self.inner.read_into(path, buffer, offset, object_size=object_size)

    def list_dir(self, path: str) -> list[str]:
        self._maybe_fail("list", path)
        return self.inner.list_dir(path)

    def exists(self, path: str) -> bool:
        self._maybe_fail("stat", path)
        return self.inner.exists(path)

    def size(self, path: str) -> int:
        self._maybe_fail("stat", path)
        return self.inner.size(path)

    def delete(self, path: str, *, recursive: bool = False) -> None:
        self._maybe_fail("delete", path)
        self.inner.delete(path, recursive=recursive)

    def rename(self, src: str, dst: str) -> None:
        self._maybe_fail("rename", dst)
        self.inner.rename(src, dst)

    def local_path(self, path: str) -> str | None:
        return self.inner.local_path(path)

    def check_writable(self) -> None:
        self.inner.check_writable()  # a preflight, not part of the run under test

    def __repr__(self) -> str:
        return f"FaultyStore({self.inner!r})"


class _CrashingSink:
    """Passes writes through until ``limit`` bytes, then fails the upload."""

    def __init__(self, sink: BinaryIO, limit: int, url: str, path: str) -> None:
        self._sink, self._left, self._url, self._path = sink, limit, url, path

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes > self._left:
            self._sink.write(view[: self._left])
            log.warning("storage.fault_injected", fault="crash_mid_upload", op="write",
                        path=self._path)
            raise StorageTransientError(
                f"write {self._url.rstrip('/')}/{self._path}: injected crash mid-upload "
                "(storage.faults.crash_after_bytes is set)")
        self._left -= view.nbytes
        return int(self._sink.write(view))

    def flush(self) -> None:
        self._sink.flush()
