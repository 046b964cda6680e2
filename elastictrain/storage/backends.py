"""Which backend serves which fsspec protocol.

A protocol without an entry is served by the generic backend (fsspec's own
calls): Google Cloud Storage (``gs://``, ``gcs://``), Azure (``az://``,
``abfs://``) and the rest need nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence

from elastictrain.storage.generic import Backend, MemoryBackend
from elastictrain.storage.local import LocalBackend
from elastictrain.storage.s3 import S3Backend

BACKENDS: dict[str, type[Backend]] = {
    "file": LocalBackend,
    "local": LocalBackend,
    "s3": S3Backend,
    "s3a": S3Backend,
    "memory": MemoryBackend,
}


def backend_for(protocol: str | Sequence[str]) -> type[Backend]:
    """The backend for an fsspec file system's ``protocol`` (a name or its aliases)."""
    names = (protocol,) if isinstance(protocol, str) else tuple(protocol)
    for name in names:
        if name in BACKENDS:
            return BACKENDS[name]
    return Backend


def is_transient(exc: BaseException, protocol: str | Sequence[str]) -> bool:
    """Whether retrying the operation that raised ``exc`` on a store of ``protocol`` (an
    fsspec protocol name or its aliases) can succeed: the protocol's backend decides."""
    return backend_for(protocol).is_transient(exc)
