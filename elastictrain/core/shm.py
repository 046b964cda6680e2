"""This user's directory in the node's shared memory (a tmpfs), where the memory tier's
directories and launchers' rescue marks live, and the lock by which a process holds a
directory there: an idle sweep removes only what no process holds."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from elastictrain.core.env import SHM_VAR
from elastictrain.core.errors import ConfigError
from elastictrain.core.localfiles import check_private_dir, open_private, private_dir, user_dir_name

LOCK = "LOCK"


def user_root() -> Path:
    """This user's directory in the node's shared tmpfs (``0700``)."""
    return user_root_in(Path(os.environ.get(SHM_VAR) or "/dev/shm"))


def user_root_in(shm: Path) -> Path:
    return shm / user_dir_name("elastictrain")


def hold(path: Path, what: str) -> int:
    """A shared lock on ``path/LOCK`` for this process's lifetime (the kernel drops it
    when the process dies). A sweep may remove the directory between our open and our
    lock: then the file we locked is gone and we start over."""
    for _ in range(10):
        fd = open_private(path / LOCK, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_SH)
        with contextlib.suppress(FileNotFoundError):
            here, held = os.stat(path / LOCK, follow_symlinks=False), os.fstat(fd)
            if (here.st_ino, here.st_dev) == (held.st_ino, held.st_dev):
                os.utime(fd)  # last use: what the idle sweep measures
                return fd
        os.close(fd)
        private_dir(path, what)
    raise OSError(errno.EAGAIN, f"{path}: removed again and again while being opened")


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[bool]:
    """Yields whether no process holds ``path`` (its ``LOCK``), holding it meanwhile."""
    try:
        fd = os.open(path / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        yield True  # never held (the directory of an opener that died before its lock)
        return
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)


def user_dirs(prefix: str) -> list[Path]:
    """This user's directories in the node's shared memory whose names start with
    ``prefix`` (none when the user's root is missing or not the user's own)."""
    root = user_root()
    try:
        check_private_dir(root, "the memory tier's root")
        entries = list(os.scandir(root))
    except (OSError, ConfigError):
        return []
    return [Path(e.path) for e in entries
            if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)]
