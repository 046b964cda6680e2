"""The exported file: written under a temporary name beside its target, made durable,
then given its name in one step, so that a reader never sees half a file and a failed
export leaves nothing behind. An existing file is replaced only when asked (``force``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from elastictrain.core.errors import ConfigError


class OutputFile:
    """Where an export goes (a local path), checked before anything is read.

    Call order: ``OutputFile(out, force)`` → ``with writing() as f:`` … ``commit()``
    inside the block. Leaving the block without ``commit`` deletes the temporary file.

    Raises (from the constructor):
        ConfigError: ``out`` is a directory, its directory does not exist, or it exists
            and ``force`` is not set.
    """

    def __init__(self, out: str | os.PathLike[str], *, force: bool) -> None:
        self.path = Path(out).expanduser()
        self._force = force
        if self.path.is_dir():
            raise ConfigError(f"--out {self.path}: a directory; fix: name the file to write, "
                              f"e.g. {self.path / 'model.safetensors'}")
        if not self.path.parent.is_dir():
            raise ConfigError(f"--out {self.path}: no directory {self.path.parent}; fix: "
                              "create it first")
        if self.path.exists() and not force:
            raise _exists(self.path)
        self._temp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:12]}.partial")
        self._committed = False

    @contextlib.contextmanager
    def writing(self) -> Iterator[tuple[int, str]]:
        """An empty temporary file beside the target, as (descriptor, path), read and
        written; deleted on the way out unless committed."""
        fd = os.open(self._temp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies
        try:
            yield fd, str(self._temp)
        finally:
            os.close(fd)
            if not self._committed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._temp)

    def commit(self, fd: int) -> None:
        """Make the written file durable and give it its name.

        Raises:
            ConfigError: the target appeared meanwhile and ``force`` is not set.
        """
        os.fsync(fd)
        if self._force:
            os.replace(self._temp, self.path)
        else:
            self._link()
        self._committed = True
        _sync_dir(self.path.parent)

    def _link(self) -> None:
        """Name the file only if the name is free (a hard link fails on an existing one)."""
        try:
            os.link(self._temp, self.path)
        except FileExistsError:
            raise _exists(self.path) from None
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
                raise
            if self.path.exists():  # a file system without hard links: check, then rename
                raise _exists(self.path) from None
            os.replace(self._temp, self.path)
            return
        os.unlink(self._temp)


def _exists(path: Path) -> ConfigError:
    return ConfigError(f"--out {path}: exists; fix: choose another path, or pass --force "
                       "(force=True) to replace it")


def _sync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # a file system that cannot sync a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
