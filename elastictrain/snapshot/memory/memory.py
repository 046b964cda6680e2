"""The node-memory tier: where a node keeps its own copy of the newest snapshot, and
how a restore uses it.

The state is replicated (DDP), so the local rank 0 of every node writes the same
snapshot to its node's memory directory through the ordinary saver and commit
protocol (manifest, checksums, atomic rename), ``keep=1``. A restart restores from
memory when the ranks agree on one memory snapshot newer than the newest durable one
(snapshot/memory/memory_choice.py): every node holds it, or, with ``memory_replicas`` on
several nodes, some node holds it and sends it to the others
(snapshot/memory/peer_restore.py); otherwise from durable storage, the source of truth.
Use, choice and figures: docs/memory-tier.md.

A memory directory belongs to one user and one durable storage: by default
``/dev/shm/elastictrain-<uid>/run-<hash of the storage URL>``, so a relaunch of the
same training finds it whatever its run id, and another job on the node (another
storage) never does. ``IDENTITY.json`` in it names the storage and run; a directory
naming another storage is refused, never loaded or deleted. Every process using it
holds a shared ``flock`` on its ``LOCK`` file (released by the kernel when the process
dies, SIGKILL included): a directory nobody holds and untouched for
``snapshot.memory_max_idle_s`` is removed by the next run of the same user on the node.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from elastictrain.core import layout
from elastictrain.core.config import SnapshotConfig
from elastictrain.core.errors import ConfigError
from elastictrain.core.localfiles import open_private, private_dir
from elastictrain.core.log import get_logger
from elastictrain.core.shm import LOCK, exclusive, hold, user_dirs, user_root
from elastictrain.handoff.rescue_marks import sweep_marks
from elastictrain.snapshot.format.reader import list_snapshot_dirs
from elastictrain.snapshot.memory.rescue import BOUNDARY_DIR
from elastictrain.snapshot.state.attempt import ATTEMPT_FILE
from elastictrain.storage import Store
from elastictrain.storage.fsspec_store import FsspecStore

log = get_logger("elastictrain.snapshot")

IDENTITY = "IDENTITY.json"
RUN_PREFIX = "run-"  # a memory directory under the user's root


def canonical_storage(url: str) -> str:
    """The durable storage a URL names, spelled one way (a local path resolved)."""
    if url.startswith("file://"):
        url = url[len("file://"):]
    if "://" not in url:
        return "file://" + os.path.realpath(url)
    return url.rstrip("/")


def memory_dir(config: SnapshotConfig, storage_url: str) -> Path:
    """The node-local directory of the memory snapshots of the run on ``storage_url``.

    Raises:
        ConfigError: ``snapshot.memory_dir`` names remote storage.
    """
    configured = config.memory_dir
    if configured is None:
        key = hashlib.sha256(canonical_storage(storage_url).encode()).hexdigest()[:16]
        return user_root() / f"{RUN_PREFIX}{key}"
    if configured.startswith("file://"):
        configured = configured[len("file://"):]
    if "://" in configured:
        raise ConfigError(f"snapshot.memory_dir={configured!r} is not a local directory; fix: "
                          "use a node-local path such as /dev/shm/<dir>, or unset it (durable "
                          "storage is snapshot storage)")
    return Path(os.path.abspath(configured))


@dataclass
class MemoryTier:
    """A memory directory this process may use: checked, and held (``LOCK``)."""

    path: Path
    store: Store
    kept: bool  # there since an earlier attempt of this run (not created now)
    lock_fd: int

    @property
    def boundary(self) -> Path:
        """Where this node's ranks keep their step-boundary records (snapshot/memory/rescue.py)."""
        return self.path / BOUNDARY_DIR

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)


def open_memory_tier(config: SnapshotConfig, run_id: str, durable: Store,
                     *, sweep_idle: bool = False) -> MemoryTier:
    """Check, create and hold this run's memory directory.

    Raises:
        ConfigError: it overlaps the durable storage; it (or the user's root) is a
            symlink, another user's or open to others; it holds another run's files.
        OSError: the node's tmpfs refused (full): the caller runs without the tier.
    """
    path = memory_dir(config, durable.url)
    _refuse_overlap(path, durable)
    what = "snapshot.memory_dir" if config.memory_dir else "the memory tier's directory"
    if config.memory_dir is None:
        private_dir(path.parent, "the memory tier's root")
        if sweep_idle:
            sweep(config.memory_max_idle_s, keep=path)
    kept = private_dir(path, what)
    fd = hold(path, what)
    try:
        _claim(path, canonical_storage(durable.url), run_id, what)
    except BaseException:
        os.close(fd)
        raise
    # No retries: a local tmpfs that refused a write (full) refuses the next one too,
    # and a memory save must never hold up the next one (the durable tier is the truth).
    store = FsspecStore(str(path), retries=0, private=True)
    return MemoryTier(path, store, kept, fd)


def _refuse_overlap(path: Path, durable: Store) -> None:
    """The memory tier prunes (``keep=1``) and at the end removes its directory: it
    must never share a file with the durable storage."""
    root = durable.local_path("")
    if root is None:
        return
    mem, dur = os.path.realpath(path), os.path.realpath(root)
    if mem == dur or mem.startswith(dur + os.sep) or dur.startswith(mem + os.sep):
        raise ConfigError(f"snapshot.memory_dir={str(path)!r} overlaps the durable storage "
                          f"{durable.url!r} (the memory tier prunes and removes its own "
                          "directory); fix: choose a memory_dir outside the durable storage, "
                          "or unset it")


def read_identity(path: Path) -> dict[str, object] | None:
    """The identity a memory directory records (None when absent or unreadable)."""
    try:
        data = json.loads((path / IDENTITY).read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _claim(path: Path, storage: str, run_id: str, what: str) -> None:
    """Make ``path`` this run's: record who it belongs to, or check that it already is.
    The same durable storage is the same training (a relaunch under a new run id
    included: its memory snapshots continue that storage's timeline)."""
    identity = read_identity(path)
    if identity is None and ((path / IDENTITY).exists() or _foreign_entries(path)):
        # Another local rank of this run may have claimed it since our read: its identity
        # is written (atomically) before anything else, so a second read tells.
        identity = read_identity(path)
        if identity is None:
            raise ConfigError(f"{what}: {path} holds files of no known run (no readable "
                              f"{IDENTITY}); they are left alone; fix: give this run a "
                              "memory_dir of its own, or remove that directory")
    mine = {"storage": storage, "run_id": run_id, "uid": os.geteuid()}
    if identity is None:  # an empty directory: ours, unless another claims it first
        if _write_identity(path, mine, only_if_absent=True):
            return
        identity = read_identity(path) or {}
    if identity.get("storage") != storage:
        raise ConfigError(f"{what}: {path} holds the memory snapshots of another run (run "
                          f"{identity.get('run_id')!r}, storage {identity.get('storage')!r}); "
                          "they are left alone; fix: give each run its own "
                          "snapshot.memory_dir, or unset it (one per storage)")
    elif identity.get("run_id") != run_id:
        _write_identity(path, mine, only_if_absent=False)


def _foreign_entries(path: Path) -> list[str]:
    """What is in ``path`` besides our own lock and identity files in the making."""
    return [n for n in os.listdir(path)
            if n != LOCK and not n.startswith(f"{IDENTITY}.tmp-")]


def _write_identity(path: Path, identity: dict[str, object], *, only_if_absent: bool) -> bool:
    """Write ``identity`` whole (a temporary file, then one link or rename). Only if absent:
    False when an identity is there already (another process claimed it first)."""
    tmp = path / f"{IDENTITY}.tmp-{os.getpid()}"
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, json.dumps(identity).encode())
        if not only_if_absent:
            os.replace(tmp, path / IDENTITY)  # same storage, a new run id: ours now
            return True
        try:
            os.link(tmp, path / IDENTITY)
        except FileExistsError:
            return False
        return True
    finally:
        os.close(fd)
        tmp.unlink(missing_ok=True)


def sweep(max_idle_s: float, keep: Path | None = None) -> list[Path]:
    """Remove this user's memory directories that no process holds and nobody used for
    ``max_idle_s`` (no run can use them any more without having touched them since),
    and launchers' rescue marks that no launcher holds (``rescue_marks.sweep_marks``).
    Returns what was removed."""
    removed = sweep_marks()
    for path in user_dirs(RUN_PREFIX):
        if path == keep:
            continue
        # (FileNotFoundError: another sweep removed it meanwhile.)
        with exclusive(path) as free, contextlib.suppress(FileNotFoundError):
            if free and time.time() - _last_used(path) >= max_idle_s:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
                log.info("snapshot.memory_removed", path=str(path), reason="idle",
                         max_idle_s=max_idle_s, tier="memory")
    return removed


def _last_used(path: Path) -> float:
    times = [os.stat(path, follow_symlinks=False).st_mtime]
    with contextlib.suppress(OSError):
        times.append(os.stat(path / LOCK, follow_symlinks=False).st_mtime)
    return max(times)


def in_use(path: Path) -> bool:
    """Whether a live process holds this memory directory."""
    with exclusive(path) as free:
        return not free


@dataclass(frozen=True)
class Held:
    """One memory directory of this user on this node (``elastictrain snapshots list
    --memory``)."""

    path: Path
    storage: str | None
    run_id: str | None
    steps: list[int]
    size_bytes: int
    in_use: bool
    idle_s: float


def held(root: Path | None = None) -> list[Held]:
    """This user's memory directories under ``root`` (default: the user's root)."""
    root = root or user_root()
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return []
    found = []
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False) or not entry.name.startswith(RUN_PREFIX):
            continue
        path = Path(entry.path)
        identity = read_identity(path) or {}
        steps = sorted((s for s in (layout.parse_step(n) for n in _names(path / layout.SNAPSHOTS))
                        if s is not None), reverse=True)
        try:  # a run may be writing and pruning here meanwhile
            idle_s = time.time() - _last_used(path)
        except FileNotFoundError:
            continue  # removed since the scan
        found.append(Held(path, _str(identity.get("storage")), _str(identity.get("run_id")),
                          steps, _size(path), in_use(path), idle_s))
    return found


def _size(path: Path) -> int:
    """Bytes of the files under ``path``; files removed while walking count as gone."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(root, name), follow_symlinks=False).st_size
    return total


def _names(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def drop_newer(store: Store, step: int | None) -> list[int]:
    """Remove memory snapshots newer than the step training resumes from (all of them
    on a fresh start): they belong to an abandoned timeline, and a later restart must
    never mix them with this one. Memory is a cache of the durable store, the source
    of truth, so dropping them loses nothing committed there. Returns the steps."""
    dropped = [s for s in list_snapshot_dirs(store) if step is None or s > step]
    for stale in dropped:
        store.delete(layout.step_dir(stale), recursive=True)
        log.info("snapshot.pruned", snapshot_step=stale, path=layout.step_dir(stale),
                 reason="stale", tier="memory")
    return dropped


def remove_all(tier: MemoryTier) -> None:
    """Remove this run's memory directory (the run finished): its snapshots, boundary
    records, identity and lock. Only ever a directory this run claimed at open."""
    for name in (layout.SNAPSHOTS, BOUNDARY_DIR):
        shutil.rmtree(tier.path / name, ignore_errors=True)
    for name in (ATTEMPT_FILE, IDENTITY, LOCK):
        with contextlib.suppress(OSError):
            (tier.path / name).unlink()
    with contextlib.suppress(OSError):  # not empty (someone else's files): leave it
        tier.path.rmdir()
    tier.release()
    log.info("snapshot.memory_removed", path=str(tier.path), reason="finished", tier="memory")


def remove_if_ours(config: SnapshotConfig, storage_url: str) -> None:
    """At the end of a finished run whose memory tier could not be opened (a full
    tmpfs): remove what an earlier attempt of this run, or our own failed claim, left
    in its memory directory; anything naming another storage is left alone."""
    path = memory_dir(config, storage_url)
    identity = read_identity(path)
    try:
        ours = (identity.get("storage") == canonical_storage(storage_url) if identity
                else not _foreign_entries(path))
    except OSError:
        return
    if ours:
        shutil.rmtree(path, ignore_errors=True)
        log.info("snapshot.memory_removed", path=str(path), reason="finished", tier="memory")


class Health:
    """Whether the memory tier (saves, boundary records) works now: a failure (a full
    tmpfs) is said once, as ``snapshot.memory_degraded``, and training goes on with
    durable snapshots; the first success after it says ``snapshot.memory_recovered``."""

    def __init__(self) -> None:
        self.degraded: dict[str, str] = {}  # what failed → why

    def failed(self, what: str, error: BaseException | str) -> None:
        if what in self.degraded:
            return
        self.degraded[what] = str(error)
        log.warning("snapshot.memory_degraded", what=what, error=str(error), tier="memory",
                    action="training goes on with durable snapshots; the memory tier and the "
                    "rescue come back once the node's memory directory has room again")

    def ok(self, what: str) -> None:
        if self.degraded.pop(what, None) is not None:
            log.info("snapshot.memory_recovered", what=what, tier="memory")
