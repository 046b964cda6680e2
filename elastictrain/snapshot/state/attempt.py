"""The job's attempt: one number that every rank of a group shares, and the one place
that names it.

torchrun's ``TORCHELASTIC_RESTART_COUNT`` is kept by each agent: a replacement or a
joining node starts at 0 while a survivor is at 1 or more, and a restart for a
membership change does not count. A number that records of other nodes are checked
against (snapshot/memory/rescue.py), and that orders the memory snapshots of different
attempts (snapshot/memory/peer_restore.py), must be the same on every rank of a group and
never repeat for a later group of the same job.

The rule: every group agrees, with one all-reduce when its managers are made, on one
more than the highest attempt any of its nodes took part in. Each node keeps the last
one it took part in (``ATTEMPT`` in its memory directory, beside the snapshots it
holds), so a node that comes back with its memory from an earlier attempt brings a
lower number than the survivors, and a relaunch of the whole job goes on counting.
Without a memory directory a node brings none: the number then only counts from what
the other nodes kept.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from elastictrain.core.localfiles import open_private
from elastictrain.worker.dist import DistContext

ATTEMPT_FILE = "ATTEMPT"
NONE_SEEN = -1  # a node that kept no attempt (new, or without a memory directory)


def last_seen(directory: Path | None) -> int:
    """The last attempt this node took part in (``NONE_SEEN``: none, or unreadable)."""
    if directory is None:
        return NONE_SEEN
    try:
        return int((directory / ATTEMPT_FILE).read_text().strip())
    except (OSError, ValueError):
        return NONE_SEEN


def agree(ctx: DistContext, seen: int) -> int:
    """(every rank) This group's attempt: one more than the highest any rank saw."""
    (highest,) = ctx.all_reduce_max([seen])
    return max(highest, NONE_SEEN) + 1


def keep(directory: Path, attempt: int) -> None:
    """(one process per node) Record ``attempt`` as the last this node took part in:
    written to a temporary file and renamed, so a reader finds the old or the new."""
    tmp = directory / f".{ATTEMPT_FILE}.{os.getpid()}"
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{attempt}\n")
        os.replace(tmp, directory / ATTEMPT_FILE)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
