"""The local file system backend (a path or ``file://``): real atomicity.

A whole object is written to a temporary name, fsynced and renamed, so it
appears whole or not at all; a create-only write links the temporary file to
its name, which fails if another writer got there first. Directories are
committed by rename, and the directory entry is fsynced so the rename survives
a crash. With ``private`` (the node-memory tier, :mod:`elastictrain.core.localfiles`)
files are created ``0600`` and directories ``0700``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from elastictrain.core.localfiles import make_private_dirs, private_opener
from elastictrain.storage.generic import Backend


class LocalBackend(Backend):
    """Local paths: atomic writes by rename, atomic directory commits."""

    CONDITIONAL_PUT = True
    SUPPORTS_RENAME = True

    @staticmethod
    def normalise_root(root: str) -> str:
        return os.path.abspath(root)

    def write_bytes(self, path: str, data: bytes, *, if_absent: bool) -> None:
        full, private = self.full(path), self.settings.private
        self.call("write", path,
                  lambda: atomic_write(full, data, if_absent=if_absent, private=private))

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        full = self.full(path)
        tmp = _temporary_name(full)
        try:
            _make_dirs(os.path.dirname(full), private=self.settings.private)
            with open(tmp, "wb", opener=_opener(private=self.settings.private)) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, full)  # appears whole or not at all
            fsync_dir(os.path.dirname(full))
        except OSError as exc:
            raise self.translate("write", path, exc, 0) from exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def rename(self, src: str, dst: str) -> None:
        full_src, full_dst = self.full(src), self.full(dst)

        def mv() -> None:
            os.rename(full_src, full_dst)
            fsync_dir(os.path.dirname(full_dst))

        self.call("rename", dst, mv)

    def local_path(self, path: str) -> str | None:
        return self.full(path)

    def prepare_root(self) -> None:
        self.call("create", "", lambda: os.makedirs(self.root, exist_ok=True))


def atomic_write(full: str, data: bytes, *, if_absent: bool, private: bool) -> None:
    """Write ``data`` to ``full`` durably and atomically; with ``if_absent``, raise
    ``FileExistsError`` if it exists."""
    directory = os.path.dirname(full)
    _make_dirs(directory, private=private)
    tmp = _temporary_name(full)
    try:
        with open(tmp, "wb", opener=_opener(private=private)) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if if_absent:
            os.link(tmp, full)  # fails with FileExistsError if another writer won
        else:
            os.replace(tmp, full)
        fsync_dir(directory)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def fsync_dir(directory: str) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temporary_name(full: str) -> str:
    return f"{full}.tmp-{uuid.uuid4().hex}"


def _make_dirs(directory: str, *, private: bool) -> None:
    if private:
        make_private_dirs(Path(directory))
    else:
        os.makedirs(directory, exist_ok=True)


def _opener(*, private: bool) -> Callable[[str, int], int] | None:
    return private_opener if private else None
