"""Rescue marks: how the workers of a node tell the agent of their launcher
(``elastictrain run``) about a rescue (``snapshot/memory/rescue.py``), so that it waits for one
before it stops a failed group (``agent.py``).

The launcher makes a private directory for the marks under this user's root in the
node's shared memory and names it to its workers in ``MARKS_ENV``: it cannot know the
memory directory, whose name comes from the storage URL the script passes. A worker is
marked ``armed-<pid>`` there while it would rescue on an uncaught error, and
``rescuing-<pid>`` while it writes a rescue. The same directory carries the agent's
request for a save before it restarts a healthy group (below).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from elastictrain.core.env import RESCUE_MARKS_VAR
from elastictrain.core.errors import ConfigError
from elastictrain.core.localfiles import open_private, private_dir
from elastictrain.core.log import get_logger
from elastictrain.core.shm import exclusive, hold, user_dirs, user_root

log = get_logger("elastictrain.snapshot")

MARKS_ENV = RESCUE_MARKS_VAR
MARKS_PREFIX = "marks-"  # a launcher's marks directory under the user's root
RESCUING = "rescuing-"  # + the PID of a process writing a rescue
ARMED = "armed-"  # + the PID of a process that rescues on an uncaught error


def launcher_marks_dir() -> Path | None:
    """The marks directory this worker's launcher named (``MARKS_ENV``); None under a
    launcher that names none (plain torchrun)."""
    named = os.environ.get(MARKS_ENV)
    return Path(named) if named else None


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
    # Made and held under a name no sweep matches, then renamed: another launcher's
    # sweep takes a marks directory without a LOCK for one whose opener died.
    making = path.with_name(f".{path.name}")
    sweep_marks()  # earlier launchers' (one SIGKILLed removes nothing itself)
    try:
        private_dir(path.parent, "the memory tier's root")
        private_dir(making, "the rescue's marks")
        fd = hold(making, "the rescue's marks")
        try:
            os.rename(making, path)
        except OSError:
            os.close(fd)
            raise
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


# -- the save before a restart of a healthy group -----------------------------------------
# When a node joins (or the rendezvous re-forms for any reason while every worker is
# healthy) torchrun stops the group and starts it again at the new size. The agent first
# asks its workers for a snapshot of the step they are at (``request_save``); they agree
# on it at the next step boundary, save, mark themselves ``ready-<pid>`` and wait to be
# stopped (snapshot/schedule/restart_save.py), so the new group resumes where the old one stood.
# A worker in ``close()`` is ready too: its loop is done, it takes no more steps. The
# agent waits only for workers that listen (a SnapshotManager made the mark): a script
# without one, or a worker still starting, has nothing to save and is never waited for.
SAVE_REQUEST = "save-before-restart"  # the agent asks for a save before it restarts
LISTENING = "listening-"  # + the PID of a worker that answers the request
READY = "ready-"  # + the PID of a worker that has nothing more to save: stop it now


def request_save(directory: Path) -> None:
    """Ask this launcher's workers for a snapshot before their group is restarted."""
    os.close(open_private(directory / SAVE_REQUEST, os.O_WRONLY | os.O_CREAT))


def save_requested(directory: Path) -> bool:
    """Whether the agent asked its workers for a save before a restart."""
    return (directory / SAVE_REQUEST).exists()


def listening_pids(directory: Path) -> set[int]:
    """PIDs of the workers that answer a request for a save (the agent waits for them)."""
    return _marked_pids(directory, LISTENING)


def ready_pids(directory: Path) -> set[int]:
    """PIDs of the workers that answered the request (saved, idle or closing): the agent
    may stop them without losing a step."""
    return _marked_pids(directory, READY)


def clear_save_marks(directory: Path) -> None:
    """Remove the request and the listening and ready marks: a new group starts without
    them."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name == SAVE_REQUEST or name.startswith((READY, LISTENING)):
                (directory / name).unlink(missing_ok=True)
