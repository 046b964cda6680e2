"""Where a ``SnapshotManager`` gets its settings and context, once, when it is built:
what the caller passed, else what ``elastictrain.init()`` set up, else the settings
file, ``ELASTICTRAIN_*`` and the environment. Nothing else in the snapshot package
reads the process-wide runtime."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastictrain.core.config import SnapshotConfig, StorageConfig, load_settings, validated
from elastictrain.core.env import WorkerEnv
from elastictrain.core.errors import ConfigError, StorageError
from elastictrain.runlog.run_marker import storage_run_id
from elastictrain.storage import Store, open_store
from elastictrain.worker import preempt, session
from elastictrain.worker.dist import DistContext, find_context


@dataclass(frozen=True)
class ManagerSetup:
    """Everything a manager takes from its surroundings.

    Attributes:
        config: the snapshot settings, the keyword overrides applied.
        ctx: the process group.
        store: the durable storage, opened.
        run_id: the job's run id (``runlog/run_marker.py``): events and manifests.
        events_dir: this worker's events directory (its earlier attempts feed the
            automatic interval; the progress file goes beside it), or None.
        preemption: the preemption watcher of this process, if one was installed.
        fixed_order_reduction: ``dist.fixed_order_reduction`` (worker/exact_reduce.py).
    """

    config: SnapshotConfig
    ctx: DistContext
    store: Store
    run_id: str
    events_dir: str | None
    preemption: preempt.PreemptionWatcher | None
    fixed_order_reduction: bool = False

    @classmethod
    def find(cls, storage: str | StorageConfig | Store, *, config: SnapshotConfig | None,
             ctx: DistContext | None, run_id: str | None,
             storage_options: dict[str, Any] | None,
             overrides: dict[str, Any]) -> ManagerSetup:
        """The manager's arguments completed from ``elastictrain.init()``'s runtime or,
        without one, the loaded settings and the environment.

        Also moves this worker's events beside these snapshots unless
        ``log.events_dir`` says where (the rule: elastictrain.runtime), so status and
        goodput read what was passed.
        """
        rt = session.current()
        settings = rt.settings if rt is not None else load_settings()
        base = (config or settings.snapshot).model_dump()
        snapshot_config = validated(SnapshotConfig, **{**base, **overrides})
        env = rt.env if rt is not None else WorkerEnv.from_environ()
        found_ctx = ctx or (rt.ctx if rt is not None else find_context(env))
        if isinstance(storage, str):
            storage = _storage_config(storage, settings.storage)
        store = (open_store(storage, storage_options)
                 if isinstance(storage, StorageConfig) else storage)
        _check_local_root(store)
        named = run_id or settings.run_id
        job_run_id = storage_run_id(store, named or env.run_id, named=named is not None)
        session.events_beside(storage if isinstance(storage, StorageConfig) else
                              settings.storage.model_copy(update={"url": store.url}),
                              job_run_id)
        # Read after events_beside: it may have moved the directory.
        events_dir = rt.events_dir if rt is not None else settings.log.events_dir
        return cls(snapshot_config, found_ctx, store, job_run_id, events_dir,
                   preempt.current(), settings.dist.fixed_order_reduction)


def _check_local_root(store: Store) -> None:
    """A local storage root that cannot be created or written (a file in the way, a
    read-only mount) is a setting to fix, not a failure to retry: one line, exit 78,
    before anything is written (an object store's access is checked by its first write).

    Raises:
        ConfigError: the root is local and not writable.
    """
    if store.local_path("") is None:
        return
    try:
        store.check_writable()
    except StorageError as exc:
        raise ConfigError(f"the snapshot storage cannot be written: {exc}; fix: pass a "
                          "directory this user can create and write, or a URL") from None


def _storage_config(url: str, configured: StorageConfig) -> StorageConfig:
    """``url`` with the configured storage settings; the configured storage options
    only for the same kind of storage (S3 credentials mean nothing to a local path)."""
    same_kind = _scheme(url) == _scheme(configured.url)
    return configured.model_copy(update={
        "url": url, "storage_options": configured.storage_options if same_kind else {}})


def _scheme(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"
