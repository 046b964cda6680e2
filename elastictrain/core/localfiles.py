"""Private local files: every file and directory elastictrain creates on a node's own
disk or tmpfs (memory snapshots, boundary records, rescue marks, locks, progress and
event files, worker logs) is the running user's alone: directories ``0700``, files
``0600``. A directory that is already there is used only when it is a real directory
(not a symlink), owned by this user and closed to everyone else; anything else is
refused with one line (``ConfigError``, exit 78), so another local user can neither read
a run's state nor plant or redirect files in it.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from elastictrain.core.errors import ConfigError

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path, what: str) -> bool:
    """Create ``path`` (missing parents too, ``0700``) or check the one there.

    Returns:
        Whether it was there already.

    Raises:
        ConfigError: ``path`` is a symlink, not a directory, another user's, or open to
            group or others (``what`` names the setting or role in the message).
    """
    try:
        os.mkdir(path, DIR_MODE)
        created = True
    except FileNotFoundError:
        make_private_dirs(path.parent)
        return private_dir(path, what)
    except FileExistsError:
        created = False
    check_private_dir(path, what)
    return not created


def make_private_dirs(path: Path) -> None:
    """``mkdir -p`` where a missing directory is created ``0700`` (one that is there
    is left as it is: a directory the user chose and owns, such as a log directory).
    ``os.makedirs`` gives only the last component the mode: parents are made here."""
    if path.is_dir():
        return
    if path.parent != path:
        make_private_dirs(path.parent)
    with contextlib.suppress(FileExistsError):  # made meanwhile by another rank
        os.mkdir(path, DIR_MODE)


def check_private_dir(path: Path, what: str) -> None:
    """Refuse ``path`` unless it is a real directory of this user with mode ``0700``
    (``lstat``: a symlink is refused, never followed)."""
    st = os.lstat(path)
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symlink"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != os.geteuid():
        problem = f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    elif st.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}, open to other users"
    if problem is not None:
        raise ConfigError(f"{what}: {path} {problem}; fix: remove it, or give this run a "
                          "directory of its own with mode 0700")


def open_private(path: Path, flags: int) -> int:
    """``os.open`` of a file of this user, created ``0600``; never through a symlink.

    A file of ours left with a wider mode (an older version's) is narrowed to ``0600``.

    Raises:
        ConfigError: the file belongs to another user.
        OSError: as ``os.open``.
    """
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise ConfigError(f"{path} belongs to uid {st.st_uid}, not to this user; fix: "
                          "remove it")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.fchmod(fd, FILE_MODE)
    return fd


def private_opener(path: str, flags: int) -> int:
    """An ``opener`` for ``open()``: the file is created ``0600`` (the umask may only
    narrow it further)."""
    return os.open(path, flags | os.O_CLOEXEC, FILE_MODE)


def user_dir_name(prefix: str) -> str:
    """``<prefix>-<uid>``: a per-user name in a directory every user shares (/dev/shm,
    /tmp), so one user's directory never blocks another's."""
    return f"{prefix}-{os.geteuid()}"


def remove_empty_dirs(directory: Path, levels: int) -> None:
    """Remove ``directory`` and up to ``levels - 1`` parents while they are empty (what
    was made for a run's events before they moved)."""
    for _ in range(levels):
        try:
            directory.rmdir()
        except OSError:  # not empty (another rank's file, snapshots) or gone
            return
        directory = directory.parent
