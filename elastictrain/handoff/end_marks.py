"""End marks: how the workers of a node tell their agent that the run's end was agreed
(``runend.agree_and_mark``), through files in a private directory the launcher holds
(``ELASTICTRAIN_END_DIR``). Shared by both processes: the workers write the marks, the
agent reads and clears them (``launcher/agent.py``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from elastictrain.core.shm import exclusive, hold

_PREFIX = "ended-"


def mark(directory: Path, pid: int) -> None:
    """Mark that worker ``pid`` passed the agreed end (no mark: the agent treats a later
    failure of it as a failure of the run)."""
    with contextlib.suppress(OSError):
        os.close(os.open(directory / f"{_PREFIX}{pid}", os.O_WRONLY | os.O_CREAT, 0o600))


END_DIR_PREFIX = "elastictrain-end-"  # a launcher's directory in the temp dir


@contextlib.contextmanager
def end_dir() -> Iterator[Path]:
    """This launcher's private directory for its workers' end marks, in the temp dir:
    held (a ``LOCK`` the kernel releases when the launcher dies) while it runs, removed
    after. Those of launchers that died without removing theirs (SIGKILL) are swept
    first; a directory is made and held under a name no sweep matches, then renamed."""
    base = Path(tempfile.gettempdir())
    sweep_end_dirs(base)
    making = Path(tempfile.mkdtemp(prefix=f".{END_DIR_PREFIX}", dir=base))
    fd = hold(making, "the end marks")
    path = base / making.name[1:]
    try:
        os.rename(making, path)
    except OSError:
        os.close(fd)
        shutil.rmtree(making, ignore_errors=True)
        raise
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)


def sweep_end_dirs(base: Path) -> list[Path]:
    """Remove this user's end-mark directories under ``base`` that no launcher holds."""
    removed = []
    for entry in base.glob(f"{END_DIR_PREFIX}*"):
        try:
            st = entry.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue  # a symlink, a file, another user's: never ours to remove
        with exclusive(entry) as free:
            if free:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def ended_pids(directory: Path) -> set[int]:
    """The pids of the workers that marked the run's end in ``directory``."""
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    return {int(n[len(_PREFIX):]) for n in names
            if n.startswith(_PREFIX) and n[len(_PREFIX):].isdigit()}


def clear(directory: Path) -> None:
    """Forget the marks of earlier workers (a new attempt; pids may be reused)."""
    for pid in ended_pids(directory):
        with contextlib.suppress(OSError):
            os.unlink(directory / f"{_PREFIX}{pid}")
