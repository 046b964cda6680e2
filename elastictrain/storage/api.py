"""The storage protocol snapshots are written through.

Paths are plain ``str`` relative to the store's root and joined with ``/``:
a remote URI would be mangled by ``pathlib``. Implementations translate their
backend's errors into :mod:`elastictrain.core.errors` and never put credentials in
a message.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, BinaryIO, Protocol, runtime_checkable


@runtime_checkable
class Store(Protocol):
    """A root location (local directory, ``memory://``, ``s3://bucket/prefix``)."""

    @property
    def url(self) -> str:
        """The root URL, safe to log (no credentials)."""
        ...

    @property
    def supports_rename(self) -> bool:
        """True when ``rename`` is atomic (local file systems), so commits can rename."""
        ...

    @property
    def supports_conditional_put(self) -> bool:
        """True when ``write_bytes(..., if_absent=True)`` is enforced by the backend."""
        ...

    def write_bytes(self, path: str, data: bytes, *, if_absent: bool = False) -> None:
        """Write a whole object durably, in one PUT on object stores.

        With ``if_absent``, raise :class:`~elastictrain.core.errors.StorageConflictError`
        if it exists (atomically where ``supports_conditional_put``).
        """
        ...

    def open_write(self, path: str) -> AbstractContextManager[BinaryIO]:
        """Stream an object. It appears, whole and durable (fsynced / upload completed),
        when the context exits cleanly; if the block raises, nothing appears."""
        ...

    def read_bytes(self, path: str) -> bytes:
        """Read a whole object."""
        ...

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        """Stream an object."""
        ...

    def read_into(self, path: str, buffer: Any, offset: int = 0, *,
                  object_size: int | None = None) -> int:
        """Fill the writable ``buffer`` (bytearray, memoryview, numpy array…) with the
        object's bytes from ``offset`` on, straight into it: object stores fetch it
        as parallel ranged GETs streamed into the buffer, holding little besides it.

        Args:
            object_size: the size the whole object must have (a manifest's): checked
                from the answers themselves on object stores (no extra request).

        Returns:
            The bytes read: always the buffer's size.

        Raises:
            ObjectSizeMismatch: the object is not ``object_size`` bytes.
            StorageError: the object ends before the buffer is full.
        """
        ...

    def list_dir(self, path: str) -> list[str]:
        """Names (not paths) directly under ``path``, from a fresh listing; [] if absent."""
        ...

    def exists(self, path: str) -> bool:
        """Whether an object or directory exists (fresh, not cached)."""
        ...

    def size(self, path: str) -> int:
        """Size of an object in bytes."""
        ...

    def delete(self, path: str, *, recursive: bool = False) -> None:
        """Delete an object or, with ``recursive``, everything under a prefix."""
        ...

    def rename(self, src: str, dst: str) -> None:
        """Atomically move a directory (only when ``supports_rename``)."""
        ...

    def local_path(self, path: str) -> str | None:
        """A local file system path for ``path`` when the store is local, else None."""
        ...

    def check_writable(self) -> None:
        """Fail early with a clear error if the root cannot be created or written."""
        ...
