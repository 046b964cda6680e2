"""Where a process's event file lives, and how it reaches the run's storage (reading
event files back: ``elastictrain.runlog.events_read``).

Every process of a run (each worker, each ``elastictrain run`` agent) appends its
events to one JSON-lines file of its own under ``<storage>/events/<run id>/``:

* workers: ``attempt{NNN}-{launch id}-rank{R}.jsonl``; NNN is torchrun's restart
  count inside one launch, the launch id tells launches of the same run apart (a
  Slurm requeue, a pod re-created, a SkyPilot recovery all reuse the run id);
* agents: ``agent-{launch id}-{host}-{pid}.jsonl``.

The launch id is the launcher's UTC start time plus a random suffix, so names
sort by launch. ``elastictrain run`` sets it for its workers
(``ELASTICTRAIN_LAUNCH_ID``); under plain torchrun each worker makes its own.

Local storage (a path or ``file://``): the files are written in place. Object
storage (``s3://`` …): appending is not possible there, so the file is written in
a local spool directory and uploaded whole, every ``log.upload_interval_s`` and
when the process exits (see docs/events.md). ``log.events_dir`` overrides the
local directory (the run id is then not appended).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from elastictrain.core.config import Settings
from elastictrain.core.env import LAUNCH_ID_VAR, getenv
from elastictrain.core.localfiles import private_opener, user_dir_name
from elastictrain.core.proc import PROC, start_ticks
from elastictrain.core.shutdown_hooks import before_interpreter_shutdown
from elastictrain.storage import Store, open_store

EVENTS_DIR = "events"


def new_launch_id() -> str:
    """A launch id: UTC start time (sorts by launch) and 4 random hex digits."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(2)


def launch_id() -> str:
    """This process's launch id: the launcher's (``elastictrain run``, the demo), else,
    under plain torchrun, one made from its agent (the parent process), so that every
    worker of one torchrun, in every attempt, has the same; else a new one."""
    global _own_launch_id
    given = getenv(LAUNCH_ID_VAR)
    if given:
        return given
    if _own_launch_id is None:
        under_torchrun = os.environ.get("TORCHELASTIC_RUN_ID") is not None
        _own_launch_id = (under_torchrun and _parent_launch_id()) or new_launch_id()
    return _own_launch_id


def _parent_launch_id() -> str | None:
    """A launch id from the parent process's start time and pid (None where ``/proc``
    cannot tell): the same in every process that parent starts."""
    parent = os.getppid()
    started_ticks = start_ticks(parent)
    try:
        boot = next(int(line.split()[1]) for line in (PROC / "stat").read_text()
                    .splitlines() if line.startswith("btime "))
    except (OSError, IndexError, ValueError, StopIteration):
        return None
    if started_ticks is None:
        return None
    started = boot + started_ticks / os.sysconf("SC_CLK_TCK")
    tag = hashlib.sha256(f"{parent}-{started_ticks}".encode()).hexdigest()[:4]
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started)) + "-" + tag


_own_launch_id: str | None = None


def is_remote(url: str) -> bool:
    """True for object storage (a URL with a scheme other than ``file://``)."""
    return "://" in url and not url.startswith("file://")


def events_root(settings: Settings) -> str:
    """The local directory under which event files go (before the run id).

    ``log.events_dir`` if set; ``<storage>/events`` for local storage; a spool
    directory in the temp dir for object storage (uploaded from there).
    """
    if settings.log.events_dir:
        return settings.log.events_dir
    url = settings.storage.url
    if is_remote(url):
        # Per user: a shared temp dir must not mix (or expose) users' spools.
        return str(Path(tempfile.gettempdir()) / user_dir_name("elastictrain-events"))
    return str(Path(url.removeprefix("file://")) / EVENTS_DIR)


def run_events_dir(settings: Settings, run_id: str) -> Path:
    """The local directory of one run's event files."""
    if settings.log.events_dir:
        return Path(settings.log.events_dir)
    return Path(events_root(settings)) / run_id


def worker_file_name(restart_count: int, rank: int, launch: str) -> str:
    return f"attempt{restart_count:03d}-{launch}-rank{rank}.jsonl"


def agent_file_name(host: str, pid: int, launch: str) -> str:
    return f"agent-{launch}-{host}-{pid}.jsonl"


@dataclass(frozen=True)
class EventSink:
    """One process's event file and, on object storage, where it is uploaded to."""

    path: Path
    upload: Uploader | None


# Tries after the first of one event upload.
UPLOAD_RETRIES = 1


def open_sink(settings: Settings, run_id: str, name: str, *, whole_dir: bool = False) -> EventSink:
    """The event file ``name`` of run ``run_id``, with its uploader on object storage
    (``whole_dir``: the uploader also copies the other files of the directory)."""
    path = run_events_dir(settings, run_id) / name
    if not is_remote(settings.storage.url):
        return EventSink(path, None)
    # Best effort, so few retries: the next upload carries the whole file anyway.
    store = open_store(settings.storage.model_copy(update={"retries": UPLOAD_RETRIES}))
    return EventSink(path, Uploader(store, f"{EVENTS_DIR}/{run_id}",
                                    settings.log.upload_interval_s, whole_dir=whole_dir))


class Uploader:
    """Copies local event files whole to ``<prefix>/<name>``, at most every ``interval_s``.

    A worker's uploader copies its own file; an agent's (``whole_dir``) copies every
    changed file of the run's local events directory, so the last events of workers
    it saw SIGKILLed still reach the storage when the agent exits.
    ``maybe_upload`` is called after each event and returns at once: the upload runs
    in a background thread, one at a time, so the training loop never waits on
    object storage. ``close`` uploads the final content and waits for it; the
    interpreter's exit does the same, before the thread pools that an object store's
    client needs stop (``core/shutdown_hooks.py``), once: later closes do nothing.
    """

    def __init__(self, store: Store, prefix: str, interval_s: float,
                 *, whole_dir: bool = False) -> None:
        self.store = store
        self.prefix = prefix
        self.interval_s = interval_s
        self.whole_dir = whole_dir
        self._last = 0.0
        self._sent: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._last_path: Path | None = None
        self._exited = False
        before_interpreter_shutdown(self._at_exit)

    def maybe_upload(self, path: Path) -> None:
        now = time.monotonic()
        self._last_path = path
        with self._lock:
            busy = self._thread is not None and self._thread.is_alive()
            if busy or now - self._last < self.interval_s:
                return
            self._last = now
            self._thread = threading.Thread(target=self._upload, args=(path,),
                                            name="elastictrain-events-upload", daemon=True)
            self._thread.start()

    def close(self, path: Path) -> None:
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()
        if not self._exited:
            self._upload(path)

    def _at_exit(self) -> None:
        if self._last_path is not None and not self._exited:
            self.close(self._last_path)
        self._exited = True

    def _upload(self, path: Path) -> None:
        from elastictrain.core.errors import StorageError

        files = sorted(path.parent.glob("*.jsonl")) if self.whole_dir else [path]
        for file in files:
            # A failed upload must not stop training: the next one carries the whole
            # file. Not logged: the event would land in a file being uploaded.
            try:
                data = file.read_bytes()
                if self._sent.get(file.name) == len(data):
                    continue
                self.store.write_bytes(f"{self.prefix}/{file.name}", data)
                self._sent[file.name] = len(data)
            except (OSError, StorageError):
                continue


# -- where a launch's workers moved their events --------------------------------------
# A launcher cannot know the storage a script gives its SnapshotManager, so its own files
# (agent events, launcher log, worker logs) start in the default events directory. Each
# worker that moves its event file beside its snapshots leaves this pointer there; at the
# end of the launch the launcher moves (or uploads) its files to the same place
# (elastictrain/launcher/gather.py): one run, one place.
def moved_to_name(launch: str) -> str:
    """The pointer's file name: one per launch (agents of several launches, e.g. two
    nodes on one machine, can share a launcher directory)."""
    return f"moved-to-{launch}.json"


@dataclass(frozen=True)
class MovedTo:
    """Where a launch's workers put their events: the run's storage (a URL safe to log),
    its run id and the local directory written (the spool on object storage)."""

    storage: str
    run_id: str
    events_dir: str


def write_moved_to(launcher_dir: Path, launch: str, moved: MovedTo) -> None:
    """Leave ``moved`` in the launcher's events directory (whole or absent; every local
    rank writes the same)."""
    tmp = launcher_dir / f".{moved_to_name(launch)}.{os.getpid()}"
    with open(tmp, "w", opener=private_opener) as f:
        json.dump(asdict(moved), f)
    os.replace(tmp, launcher_dir / moved_to_name(launch))


def read_moved_to(launcher_dir: Path, launch: str) -> MovedTo | None:
    """The pointer a worker of ``launch`` left (None: no worker moved its events)."""
    try:
        data = json.loads((launcher_dir / moved_to_name(launch)).read_text())
        return MovedTo(str(data["storage"]), str(data["run_id"]), str(data["events_dir"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
