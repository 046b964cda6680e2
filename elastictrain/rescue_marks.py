"""Rescue marks: how the workers of a node tell the agent of their launcher
(``elastictrain run``) about a rescue (``snapshot/rescue.py``), so that it waits for one
before it stops a failed group (``agent.py``).

The launcher makes a private directory for the marks under this user's root in the
node's shared memory and names it to its workers in ``MARKS_ENV``: it cannot know the
memory directory, whose name comes from the storage URL the script passes. A worker is
marked ``armed-<pid>`` there while it would rescue on an uncaught error, and
``rescuing-<pid>`` while it writes a rescue.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from elastictrain.env import RESCUE_MARKS_VAR
from elastictrain.errors import ConfigError
from elastictrain.localfiles import private_dir
from elastictrain.log import get_logger
from elastictrain.shm import exclusive, hold, user_dirs, user_root

log = get_logger("elastictrain.snapshot")

MARKS_ENV = RESCUE_MARKS_VAR
MARKS_PREFIX = "marks-"  # a launcher's marks directory under the user's root
RESCUING = "rescuing-"  # + the PID of a process writing a rescue
ARMED = "armed-"  # + the PID of a process that rescues on an uncaught error


def rescuing_pids(directory: Path) -> set[int]:
    """PIDs of the processes writing a rescue in ``directory`` now (the agent waits for
    them before it stops a failed group)."""
    return _marked_pids(directory, RESCUING)


def armed_pids(directory: Path) -> set[int]:
    """PIDs of the processes that would rescue on an uncaught error: a survivor of a
    failure may not have seen its error yet when the agent sees the failed worker."""
    return _marked_pids(directory, ARMED)


def _marked_pids(directory: Path, prefix: str) -> set[int]:
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    return {int(n.removeprefix(prefix)) for n in names
            if n.startswith(prefix) and n.removeprefix(prefix).isdigit()}


@contextlib.contextmanager
def launch_marks() -> Iterator[Path | None]:
    """A private directory for this launcher's rescue marks, named to its workers in
    ``MARKS_ENV``, held while it runs and removed after. None (the agent then waits for
    no rescue) where the node's tmpfs refuses it."""
    path = user_root() / f"{MARKS_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
    sweep_marks()  # earlier launchers' (one SIGKILLed removes nothing itself)
    try:
        private_dir(path.parent, "the memory tier's root")
        private_dir(path, "the rescue's marks")
        fd = hold(path, "the rescue's marks")
    except (OSError, ConfigError) as exc:
        log.warning("snapshot.memory_degraded", what="rescue marks", error=str(exc),
                    tier="memory", action="the agent stops a failed group without waiting "
                    "for a rescue")
        yield None
        return
    os.environ[MARKS_ENV] = str(path)
    try:
        yield path
    finally:
        os.environ.pop(MARKS_ENV, None)
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)


def sweep_marks() -> list[Path]:
    """Remove every launcher's marks directory under this user's root that no launcher
    holds: the marks serve only the launcher that made them, whatever their age."""
    removed = []
    for path in user_dirs(MARKS_PREFIX):
        with exclusive(path) as free:
            if free:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
                log.info("snapshot.memory_removed", path=str(path), reason="launcher gone",
                         tier="memory")
    return removed
