"""The node-memory tier: where a node keeps its own copy of the newest snapshot, and
the rule by which all ranks agree to restore from it.

The state is replicated (DDP), so the local rank 0 of every node writes the same
snapshot to its node's memory directory through the ordinary saver and commit
protocol (manifest, checksums, atomic rename), ``keep=1``. A restart restores from
memory only when every node holds that same step and it is newer than the newest
durable snapshot; otherwise from durable storage, the source of truth. Use, choice
and figures: docs/memory-tier.md.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

from elastictrain.config import SnapshotConfig
from elastictrain.errors import ConfigError
from elastictrain.log import get_logger
from elastictrain.snapshot import layout
from elastictrain.snapshot.reader import list_snapshot_dirs
from elastictrain.snapshot.rescue import BOUNDARY_DIR
from elastictrain.storage import Store, open_store

log = get_logger("elastictrain.snapshot")

DEFAULT_ROOT = "/dev/shm/elastictrain"
NO_STEP = -1  # a rank whose node holds no committed memory snapshot


def memory_dir(config: SnapshotConfig, run_id: str) -> Path:
    """The node-local directory of this run's memory snapshots.

    Raises:
        ConfigError: ``snapshot.memory_dir`` names remote storage.
    """
    configured = config.memory_dir
    if configured is None:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", run_id) or "run"
        return Path(DEFAULT_ROOT) / safe
    if configured.startswith("file://"):
        configured = configured[len("file://"):]
    if "://" in configured:
        raise ConfigError(f"snapshot.memory_dir={configured!r} is not a local directory; fix: "
                          "use a node-local path such as /dev/shm/elastictrain/<run>, or unset "
                          "it (durable storage is snapshot storage)")
    return Path(configured)


def boundary_dir(config: SnapshotConfig, run_id: str) -> Path:
    """Where this node's ranks keep their step-boundary records and rescue marks
    (snapshot/rescue.py); the agent finds it the same way."""
    return memory_dir(config, run_id) / BOUNDARY_DIR


def open_memory_store(config: SnapshotConfig, run_id: str) -> tuple[Store, bool]:
    """The Store on this node's memory directory (created if missing), and whether it
    was there already: this node kept its memory since an earlier attempt of the run
    (the directory lives until the run ends; a replaced or rebooted node has none)."""
    path = memory_dir(config, run_id)
    kept = path.is_dir()
    path.mkdir(parents=True, exist_ok=True)
    return open_store(str(path)), kept


def skip_reason(highest: int, lowest: int, durable_step: int) -> str | None:
    """Why the ranks must not restore from memory, or None when they may.

    Args:
        highest, lowest: the largest and smallest newest-memory-step over all ranks
            (``NO_STEP`` where a node holds none), from one all-reduce.
        durable_step: the newest durable snapshot's step (``NO_STEP`` when none).
    """
    if highest == NO_STEP:
        return "no memory snapshot"
    if lowest != highest:
        return "not every node holds the same step"
    if highest <= durable_step:
        return "not newer than the durable snapshot"
    return None


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


def remove_all(store: Store) -> None:
    """Remove this node's memory snapshots and directory (a run that finished)."""
    store.delete(layout.SNAPSHOTS, recursive=True)
    store.delete(BOUNDARY_DIR, recursive=True)  # the rescue's records (snapshot/rescue.py)
    root = store.local_path("")
    if root is not None:
        with contextlib.suppress(OSError):  # not empty (someone else's files): leave it
            Path(root).rmdir()
    log.info("snapshot.memory_removed", path=store.url)
