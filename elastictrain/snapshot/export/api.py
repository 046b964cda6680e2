"""``elastictrain.export`` (and ``elastictrain snapshots export``): the model, and the
optimizer when asked for, of a verified snapshot as one file, safetensors or torch.

(operator, one process) pick the snapshot: ``step``, or the newest that verifies →
check the target (before any read) → lay the file out under a temporary name → read
the snapshot one tensor at a time, each written to its place → the snapshot verified
(a replicated payload's checksum over the same pass; a sharded snapshot's objects
before, each chunk again as it is read) → the file named. Memory: the largest tensor
and a few buffers, whatever the model's size. Nothing in the storage is written.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from elastictrain.core import layout
from elastictrain.core.errors import ConfigError, SnapshotCorrupt
from elastictrain.core.log import get_logger
from elastictrain.snapshot.export import contents
from elastictrain.snapshot.export.output import OutputFile
from elastictrain.snapshot.export.replicated import ReplicatedSource
from elastictrain.snapshot.export.writers import FORMATS, require_safetensors, writer_for
from elastictrain.snapshot.format.manifest import SHARDED_FORMAT_VERSION, Manifest
from elastictrain.snapshot.format.reader import list_snapshot_dirs, newest_first, read_manifest
from elastictrain.storage.api import Store
from elastictrain.storage.locations import open_from_cli

log = get_logger("elastictrain.snapshot")

_STEPS_SHOWN = 10


@dataclass(frozen=True)
class Exported:
    """What an export wrote: the file, the snapshot's step, the format, what it holds
    (``model``, and ``optimizer`` when asked for), its tensors and bytes."""

    path: str
    step: int
    format: str
    contents: tuple[str, ...]
    tensors: int
    size_bytes: int


def export(storage: str | Store, out: str | os.PathLike[str], *, step: int | None = None,
           format: str = "safetensors", with_optimizer: bool = False,
           force: bool = False) -> Exported:
    """Write the model (and with ``with_optimizer`` the optimizer) of a verified snapshot
    to ``out`` as one file, from a replicated (DDP) or sharded (FSDP2 / DCP) snapshot of
    any world size; the tensors are named as the unwrapped model's ``state_dict()``
    names them (docs/export.md).

    Args:
        storage: the run's storage root (a directory or URL, as given to
            ``SnapshotManager``), or an open Store.
        out: the file to write (local); it appears only once complete and verified.
        step: the snapshot's step; default: the newest snapshot that verifies (a newer
            one that does not is logged as ``snapshot.corrupt`` and skipped).
        format: ``"safetensors"`` (needs ``pip install 'elastictrain[safetensors]'``) or
            ``"torch"`` (a ``torch.load(weights_only=True)`` file of ``{"model",
            ["optimizer",] "elastictrain"}``).
        with_optimizer: also the optimizer's state.
        force: replace ``out`` if it exists.

    Raises:
        ConfigError: bad input: the format, ``out`` (exists, a directory, no such
            directory), a storage that is malformed, missing or holds no snapshots,
            a ``step`` that is not there, safetensors missing, ``with_optimizer``
            without optimizer state, a value the format cannot hold.
        SnapshotCorrupt: the snapshot of ``step`` (or every snapshot) does not verify:
            partial, missing or damaged; nothing was written.
        SnapshotUnloadable: it verifies but holds no state this can export.
        StorageError: a read failed (after the store's retries).
    """
    fmt = _checked_format(format)
    target = OutputFile(out, force=force)
    store = open_from_cli(storage, None) if isinstance(storage, str) else storage
    _refuse_inside_snapshots(store, target.path)
    for manifest in _snapshots(store, step):
        started = time.perf_counter()
        try:
            done = _export_one(store, manifest, target, fmt, with_optimizer)
        except SnapshotCorrupt as exc:
            if step is not None:
                raise _refused(store, manifest.step, exc) from exc
            log.warning("snapshot.corrupt", snapshot_step=manifest.step, reason=str(exc),
                        action="skipped, exporting the previous snapshot")
            continue
        log.info("snapshot.exported", snapshot_step=done.step, format=fmt, path=done.path,
                 tensors=done.tensors, size_bytes=done.size_bytes,
                 duration_s=round(time.perf_counter() - started, 4))
        return done
    raise SnapshotCorrupt(f"no snapshot under {store.url} verifies; nothing was exported; "
                          "fix: `elastictrain snapshots verify` says why each fails")


def _checked_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ConfigError(f"format={fmt!r}: not a format elastictrain exports; fix: one of "
                          f"{', '.join(FORMATS)}")
    if fmt == "safetensors":
        require_safetensors()
    return fmt


def _refuse_inside_snapshots(store: Store, path: Path) -> None:
    """A file among the snapshots would be an object retention may delete."""
    snapshots = store.local_path(layout.SNAPSHOTS)
    if snapshots is not None and Path(snapshots).resolve() in path.resolve().parents:
        raise ConfigError(f"--out {path}: inside the run's {layout.SNAPSHOTS}/ directory, "
                          "which only elastictrain writes; fix: write it elsewhere")


def _snapshots(store: Store, step: int | None) -> Iterator[Manifest]:
    """The manifest of ``step``, or every committed manifest from the newest down (a
    partial or corrupt manifest logged and skipped)."""
    steps = list_snapshot_dirs(store)
    if not steps:
        raise ConfigError(f"no snapshots under {store.url}; fix: check the storage URL (the "
                          "run root a job wrote with --storage, which holds snapshots/)")
    if step is not None:
        if step not in steps:
            raise _no_such_step(store, step, steps)
        try:
            yield read_manifest(store, step)
        except SnapshotCorrupt as exc:
            raise _refused(store, step, exc) from exc
        return
    for candidate in newest_first(store):
        if candidate.manifest is None:
            log.warning("snapshot.corrupt", snapshot_step=candidate.step,
                        reason=candidate.problem,
                        action="skipped, exporting the previous snapshot")
            continue
        yield candidate.manifest


def _export_one(store: Store, manifest: Manifest, target: OutputFile, fmt: str,
                with_optimizer: bool) -> Exported:
    where = f"{store.url}/{layout.step_dir(manifest.step)}"
    source = _source(store, manifest)
    try:
        tree = contents.select(source.tree, with_optimizer=with_optimizer, where=where)
        meta = contents.describe(manifest, with_optimizer=with_optimizer)
        order = source.order([ref for _, ref in contents.tensor_refs(tree)])
        with target.writing() as (fd, temp):
            writer = writer_for(fmt, fd, temp, tree, meta, order)
            for ref, tensor in source.tensors(order):
                writer.put(ref, tensor)
                del tensor  # freed before the next one is read
            source.finish()
            writer.finish()
            target.commit(fd)
    finally:
        source.close()
    return Exported(str(target.path), manifest.step, fmt, tuple(tree), len(order),
                    target.path.stat().st_size)


def _source(store: Store, manifest: Manifest) -> contents.Source:
    if manifest.format_version != SHARDED_FORMAT_VERSION:
        return ReplicatedSource(store, manifest)
    from elastictrain.snapshot.export.sharded import ShardedSource  # DCP: sharded only

    return ShardedSource(store, manifest)


def _refused(store: Store, step: int, exc: Exception) -> SnapshotCorrupt:
    reason = " ".join(str(exc).split())
    return SnapshotCorrupt(f"snapshot of step {step} under {store.url} does not verify, "
                           f"nothing was exported: {reason}; fix: export another step "
                           "(`elastictrain snapshots verify` lists those that verify)")


def _no_such_step(store: Store, step: int, steps: list[int]) -> ConfigError:
    shown = ", ".join(str(s) for s in steps[:_STEPS_SHOWN])
    more = f" and {len(steps) - _STEPS_SHOWN} older" if len(steps) > _STEPS_SHOWN else ""
    return ConfigError(f"no snapshot of step {step} under {store.url}; steps there, newest "
                       f"first: {shown}{more}; fix: pass one of them with --step")
