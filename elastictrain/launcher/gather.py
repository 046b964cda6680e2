"""At the end of a launch, the launcher's files join the run's: one run, one place.

``elastictrain run`` starts before any worker has named its storage (a script gives it
to its ``SnapshotManager``), so the agent's events, the launcher log and the workers'
output begin in the default events directory (``./elastictrain-run/events/<id>/``).
Each worker moves its own event file beside its snapshots and leaves a pointer
(``runlog.events.MovedTo``). Once the launch has ended, this module moves the
launcher's files there (local storage) or uploads them (object storage), removes the
links the workers left, and removes the default directory when nothing else is in it.
A directory the user named (``log.events_dir``, ``--log-dir``) is never touched, and a
failed upload leaves the files where they are.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from elastictrain.core import log as et_log
from elastictrain.core.config import Settings
from elastictrain.core.errors import StorageError
from elastictrain.core.localfiles import remove_empty_dirs
from elastictrain.runlog.events import (
    EVENTS_DIR,
    MovedTo,
    is_remote,
    moved_to_name,
    read_moved_to,
)
from elastictrain.storage import open_store
from elastictrain.view.run import WORKER_LOGS_DIR, RunOutput

log = et_log.get_logger("elastictrain.agent")


@dataclass(frozen=True)
class Gathered:
    """Where the launch's files are now: a local directory, or a URL on object storage."""

    location: str
    remote: bool

    def path_of(self, launcher_dir: Path, old: str | Path) -> str:
        """Where a file or directory once under ``launcher_dir`` is now (``old`` itself
        when it was elsewhere: a log directory the user named)."""
        try:
            relative = Path(os.path.abspath(old)).relative_to(os.path.abspath(launcher_dir))
        except ValueError:
            return str(old)
        return f"{self.location.rstrip('/')}/{relative.as_posix()}"

    def output_of(self, launcher_dir: Path, output: RunOutput) -> RunOutput:
        """``output``'s paths, once moved."""
        return RunOutput(self.location, self.path_of(launcher_dir, output.worker_logs),
                         self.path_of(launcher_dir, output.launcher_log))


def gather(launcher_dir: Path, launch: str, settings: Settings) -> Gathered | None:
    """Bring launch ``launch``'s files in ``launcher_dir`` to where its workers' events
    went. None when there is nothing to do: the user named the events directory, no
    worker moved its events, or they are already here."""
    if settings.log.events_dir:
        return None
    moved = read_moved_to(launcher_dir, launch)
    if moved is None:
        return None
    if is_remote(moved.storage):
        return _upload(launcher_dir, launch, moved, settings)
    target = Path(moved.events_dir)
    if os.path.abspath(target) == os.path.abspath(launcher_dir):
        return None
    _move_local(launcher_dir, launch, target)
    return Gathered(str(target), remote=False)


def _own_files(launcher_dir: Path, launch: str) -> list[Path]:
    """The files of launch ``launch`` (not its workers' links, nor its pointer): its
    agents' events, the launcher log, its workers' output. Another launch sharing the
    directory (a second agent on this machine) keeps its own."""
    names = [f"launcher-{launch}.log", f"{WORKER_LOGS_DIR}/{launch}"]
    found = [launcher_dir / name for name in names if (launcher_dir / name).exists()]
    found += sorted(launcher_dir.glob(f"agent-{launch}-*.jsonl"))
    return [p for p in found if not p.is_symlink()]


def _move_local(launcher_dir: Path, launch: str, target: Path) -> None:
    own_events = et_log.events_file()
    for entry in _own_files(launcher_dir, launch):
        destination = target / entry.relative_to(launcher_dir)
        destination.parent.mkdir(parents=True, exist_ok=True)
        if own_events is not None and entry == own_events:
            et_log.move_events_file(destination)  # still open: go on appending there
        elif not destination.exists():
            shutil.move(entry, destination)
    _remove_links_and_pointer(launcher_dir, launch)
    _remove_empty(launcher_dir)


def _upload(launcher_dir: Path, launch: str, moved: MovedTo, settings: Settings
            ) -> Gathered | None:
    store = open_store(settings.storage.model_copy(update={"url": moved.storage}))
    prefix = f"{EVENTS_DIR}/{moved.run_id}"
    own = _own_files(launcher_dir, launch)
    try:
        for entry in own:
            files = [entry] if entry.is_file() else [p for p in entry.rglob("*")
                                                     if p.is_file() and not p.is_symlink()]
            for path in files:
                name = path.relative_to(launcher_dir).as_posix()
                store.write_bytes(f"{prefix}/{name}", path.read_bytes())
    except (StorageError, OSError) as exc:
        log.warning("agent.gather_failed", storage=moved.storage, error=str(exc)[:300])
        return None
    # The agent's own file stays open: a late line goes to the removed file, never
    # re-creating the directory.
    for entry in own:
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    _remove_links_and_pointer(launcher_dir, launch)
    _remove_empty(launcher_dir)
    return Gathered(f"{store.url.rstrip('/')}/{prefix}", remote=True)


def _remove_links_and_pointer(launcher_dir: Path, launch: str) -> None:
    """The links to this launch's workers' files (their targets are in place) and its
    pointer."""
    links = [p for p in launcher_dir.glob(f"attempt*-{launch}-rank*.jsonl") if p.is_symlink()]
    for entry in [*links, launcher_dir / moved_to_name(launch)]:
        with contextlib.suppress(OSError):
            entry.unlink()


def _remove_empty(launcher_dir: Path) -> None:
    """torchelastic/, then <id>/, events/ and the default storage root, while empty."""
    remove_empty_dirs(launcher_dir / WORKER_LOGS_DIR, levels=1)
    remove_empty_dirs(launcher_dir, levels=3)
