"""Restore of a sharded snapshot, at the saved or another world size.

Call order and roles::

    (rank 0) list snapshot directories, newest first → broadcast
    for each step, newest first:
        (rank 0) manifest (format 2) → read + verify the DCP metadata and the
                 training state → broadcast all but the training state
        (all)    every part exists with its size: each rank asks for its share of
                 the parts (about one: rank 0 alone would ask N times in a row), and
                 one all-reduce agrees on the outcome
        (all)    get_state_dict at the current world size → DCP load through
                 StoreReader (each item verified before it is copied) →
                 set_state_dict → the training state from rank 0, each rank
                 receiving its own RNG state (not all N)
        a missing part or a checksum mismatch on any rank: every rank learns it
        (DCP gathers every rank's outcome) and tries the previous step; a read
        error fails the attempt (torchrun retries), never a fallback.

No rank reads more than the items its new shards overlap.
"""

from __future__ import annotations

import time
from typing import Any

from torch import nn
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.api import CheckpointException

from elastictrain.core import layout
from elastictrain.core.errors import SnapshotCorrupt, SnapshotUnloadable, StorageError
from elastictrain.core.log import get_logger
from elastictrain.snapshot.durable.restore import LoadedSnapshot, scatter_rng
from elastictrain.snapshot.format.manifest import SHARDED_FORMAT_VERSION, Manifest
from elastictrain.snapshot.format.reader import (
    list_snapshot_dirs,
    load_checked_bytes,
    read_manifest,
)
from elastictrain.snapshot.format.sharded_reader import check_parts, object_of, read_object
from elastictrain.snapshot.sharded.dcp_io import StoreReader, WeightsOnlyLoadPlanner, parse_metadata
from elastictrain.snapshot.sharded.state import apply_state, current_state
from elastictrain.storage.api import Store
from elastictrain.worker.dist import DistContext

log = get_logger("elastictrain.snapshot")

_Header = tuple[bytes, bytes, bytes]  # manifest JSON, DCP metadata, training state


def load_newest_sharded(store: Store, ctx: DistContext, group: Any | None, model: nn.Module,
                        optimizer: Any | None,
                        only: list[int] | None = None) -> LoadedSnapshot | None:
    """Load the newest sharded snapshot that verifies into ``model`` and ``optimizer`` on
    every rank; return its training state (no model/optimizer), or None if there is none.
    ``only``: the steps to try (every rank passes the same), instead of every step rank 0
    lists (the memory tier: each rank reads its own node's directory).

    Raises:
        StorageError: a read failed (not corruption: the attempt fails, no fallback).
        SnapshotCorrupt: a corrupt snapshot was partly loaded and no older one verifies
            (the model is no longer the fresh one).
    """
    steps: list[int] = only if only is not None else ctx.broadcast_object(
        list_snapshot_dirs(store) if ctx.is_writer else None)
    touched = False
    for step in steps:
        started = time.perf_counter()
        full, reason, fatal = _header(store, step) if ctx.is_writer else (None, None, None)
        train = b"" if full is None else full[2]
        # The training state stays on rank 0: each rank receives its share after the load.
        sent = None if full is None else (full[0], full[1], b"")
        header, reason, fatal = ctx.broadcast_object((sent, reason, fatal))
        if fatal is not None:  # rank 0's read error or unloadable state: every rank stops
            raise fatal
        if header is None:
            log.warning("snapshot.corrupt", snapshot_step=step, reason=reason,
                        action="skipped, trying the previous snapshot")
            continue
        manifest = Manifest.from_json(header[0], f"{store.url}/{layout.step_dir(step)}")
        where = f"{store.url}/{layout.step_dir(step)}"
        missing = _parts_missing(store, ctx, manifest)
        if missing is not None:
            log.warning("snapshot.corrupt", snapshot_step=step, reason=missing,
                        action="skipped, trying the previous snapshot")
            continue
        metadata = parse_metadata(header[1], where)
        state = current_state(model, optimizer)
        reader = StoreReader(store, layout.step_dir(step), metadata, manifest.checksum_algorithm)
        try:
            dcp_load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner(),
                     process_group=group, no_dist=not ctx.initialized)
        except CheckpointException as exc:
            touched = True
            log.warning("snapshot.corrupt", snapshot_step=step, reason=_corruption(exc),
                        action="skipped, trying the previous snapshot")
            continue
        apply_state(model, optimizer, state)
        log.info("snapshot.discovered", snapshot_step=step, size_bytes=manifest.total_bytes,
                 bytes_read=reader.bytes_read, restore_mode="sharded",
                 duration_s=round(time.perf_counter() - started, 4))
        return LoadedSnapshot(step, _training_state(ctx, train, where), manifest.total_bytes)
    if touched:
        raise SnapshotCorrupt(f"{store.url}: no sharded snapshot verifies, and a corrupt one "
                              "was partly loaded into the model; fix: restore a good "
                              "snapshot into the storage, or start with an empty location")
    return None


def _training_state(ctx: DistContext, train: bytes, where: str) -> dict[str, Any]:
    """Rank 0's verified training state on every rank: the RNG states scattered (each
    rank its own and rank 0's), the rest (step, sampler, extras…, small) broadcast."""
    state = load_checked_bytes(train, where) if ctx.is_writer else None
    rng = state.pop("rng") if state is not None else None
    rest = ctx.broadcast_object(state)
    shared = scatter_rng(ctx, rng)
    rest["rng"] = rng if rng is not None else shared
    return dict(rest)


def _header(store: Store, step: int) -> tuple[_Header | None, str | None, Exception | None]:
    """(rank 0) the manifest, DCP metadata and training state of ``step``, verified:
    (header, None, None), or (None, why it is corrupt, None), or (None, None, the read
    error or unloadable state that must stop every rank)."""
    where = f"{store.url}/{layout.step_dir(step)}"
    try:
        manifest = read_manifest(store, step)
        if manifest.format_version != SHARDED_FORMAT_VERSION:
            raise SnapshotCorrupt(f"{where}: a replicated (format {manifest.format_version}) "
                                  "snapshot; a sharded model restores sharded snapshots only")
        metadata = read_object(store, manifest, object_of(manifest, "dcp-", where))
        parse_metadata(metadata, where)  # here, where a failure skips the step on every rank
        train = read_object(store, manifest, object_of(manifest, "train-", where))
        load_checked_bytes(train, where)
    except SnapshotCorrupt as exc:
        return None, str(exc), None
    except (StorageError, SnapshotUnloadable) as exc:
        return None, None, exc
    return (manifest.to_json(), metadata, train), None, None


def _parts_missing(store: Store, ctx: DistContext, manifest: Manifest) -> str | None:
    """Why the snapshot is corrupt when a part is missing or has another size on any
    rank's share, else None; a read error on any rank fails every rank."""
    error: Exception | None = None
    status = 0  # 0 fine, 1 corrupt, 2 read error
    try:
        check_parts(store, manifest, manifest.objects[ctx.rank::ctx.world_size])
    except SnapshotCorrupt as exc:
        status, error = 1, exc
    except Exception as exc:  # every rank must learn of it, or the others hang
        status, error = 2, exc
    worst, lowest = ctx.all_reduce_max([status, ctx.world_size - ctx.rank if status else 0])
    if worst == 2:
        if status == 2 and error is not None:
            raise error
        raise StorageError(f"{store.url}/{layout.step_dir(manifest.step)}: another rank "
                           "could not read a part's size (its log says why); no rank "
                           "resumes alone, torchrun retries the attempt")
    if worst == 0:
        return None
    # Every rank logs the first failing rank's reason (sent only when there is one).
    return str(ctx.broadcast_object(str(error), src=ctx.world_size - lowest))


def _corruption(exc: CheckpointException) -> str:
    """The reason if every failure is corruption; else re-raise the first read error."""
    reasons = []
    for rank, (error, _trace) in sorted(exc.failures.items()):
        if not isinstance(error, SnapshotCorrupt):
            raise StorageError(f"rank {rank}: reading the snapshot failed: "
                               f"{type(error).__name__}: {error}") from error
        reasons.append(f"rank {rank}: {error}")
    return "; ".join(reasons)
