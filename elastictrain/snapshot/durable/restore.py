"""Restore: every rank loads the same newest snapshot that verifies, or all fail.

Call order and roles::

    (rank 0) list and read manifests, newest first → broadcast the committed ones
    (all)    check they see rank 0's newest manifest (node-local storage?)
    for each committed snapshot, newest first:
        mode "each":      (all) read + verify + deserialize from storage
        mode "broadcast": (rank 0) read + verify + deserialize →
                          (all) receive its storages over the process group, and
                          each rank its own RNG state (scattered, not broadcast)
        (all) agree on the worst outcome: loaded everywhere → done; corrupt
              somewhere → log snapshot.corrupt and try the previous step; a read
              error or an unloadable payload anywhere → every rank raises

A faster tier (node memory: snapshot/memory/memory_load.py) may answer first: the
caller hands ``load_newest`` its load (``memory_first``), which gets the newest
durable snapshot's manifest and the agreement on written tensors, and returns what
every rank agreed on and loaded, or None: then the durable loop runs. Durable storage
is the source of truth.

Every rank verifies what it read before anything is applied, and all ranks
take a step, skip it or fail together, so no rank resumes alone or from another
step than its peers. The default mode, "auto", is "each" on a local file system
(ranks share the page cache) and "broadcast" elsewhere (each byte read from the
object store once). Measurements: docs/restore.md.

In mode "each" (and from a faster tier), the model's own tensors are read into
directly (``in_place``, snapshot/format/onepass.py): they hold unverified bytes until the
snapshot verifies. A snapshot that does not verify is followed by the next older
one, whose load overwrites every model tensor again; when none is left, the
process cannot start fresh from the model's initial values and raises
``RestoreOverwrote`` on every rank instead of starting at step 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from elastictrain.core import layout
from elastictrain.core.errors import (
    ConfigError,
    ElasticTrainError,
    RestoreOverwrote,
    SnapshotCorrupt,
    SnapshotUnloadable,
    StorageError,
)
from elastictrain.core.log import get_logger
from elastictrain.snapshot.format.commitmark import is_committed
from elastictrain.snapshot.format.manifest import Manifest
from elastictrain.snapshot.format.reader import newest_first, verify_snapshot
from elastictrain.snapshot.format.views import InPlace, StorageIndex, as_bytes, from_views, to_views
from elastictrain.storage.api import Store
from elastictrain.worker.dist import DistContext

log = get_logger("elastictrain.snapshot")


@dataclass(frozen=True)
class LoadedSnapshot:
    """The state of one verified snapshot, as loaded on this rank."""

    step: int
    payload: dict[str, Any]
    size_bytes: int
    tier: str = "durable"
    peer_rank: int | None = None  # memory: the rank whose node's copy this node received


class Status(IntEnum):
    """Outcome of loading one snapshot on one rank; ranks agree on the worst (max)."""

    OK = 0
    CORRUPT = 1
    UNLOADABLE = 2
    FAILED = 3


@dataclass(frozen=True)
class Outcome:
    status: Status
    loaded: LoadedSnapshot | None = None
    error: Exception | None = None


class Written:
    """Whether any rank's in-place tensors were written, agreed with each outcome. Only
    a failed load leaves them so, and restore stops at the first verified one (its
    load overwrites every in-place tensor)."""

    def __init__(self, ctx: DistContext, in_place: InPlace | None) -> None:
        self._ctx = ctx
        self.in_place = in_place
        self.anywhere = False

    def agree(self, status: Status) -> Status:
        """The worst status on any rank; notes whether a rank wrote its tensors."""
        touched = self.in_place is not None and self.in_place.touched
        worst, touched_somewhere = self._ctx.all_reduce_max([status, int(touched)])
        self.anywhere = self.anywhere or bool(touched_somewhere)
        return Status(worst)


# A faster tier's load (node memory), asked before durable storage on every rank: it
# gets the newest durable manifest (None: none) and the agreement on written tensors.
MemoryFirst = Callable[[Manifest | None, Written], LoadedSnapshot | None]


def resolve_mode(store: Store, mode: str) -> str:
    """The restore mode to use: ``"auto"`` is ``"each"`` on a local file system and
    ``"broadcast"`` on any other store."""
    if mode != "auto":
        return mode
    return "each" if store.local_path(layout.SNAPSHOTS) is not None else "broadcast"


def load_newest(store: Store, ctx: DistContext, mode: str = "auto",
                in_place: InPlace | None = None,
                memory_first: MemoryFirst | None = None) -> LoadedSnapshot | None:
    """The newest snapshot that verifies on every rank, loaded everywhere; None if none.

    Args:
        mode: ``"each"`` (every rank reads storage), ``"broadcast"`` (rank 0 reads and
            sends the state over the process group) or ``"auto"`` (see ``resolve_mode``).
        in_place: the model's tensors, read into directly where this rank reads a
            local payload itself (module docstring).
        memory_first: a faster tier's load, asked first on every rank alike (module
            docstring).

    Raises:
        StorageError: a read failed on some rank (after the store's retries); every
            rank raises, so torchrun retries the attempt.
        SnapshotUnloadable: the newest snapshot verifies but does not deserialize.
        ConfigError: a rank does not see the snapshots rank 0 sees.
        RestoreOverwrote: none verifies, and ``in_place`` tensors were written.
    """
    mode = resolve_mode(store, mode)
    manifests = _discover(store, ctx)
    written = Written(ctx, in_place)
    if memory_first is not None:
        loaded = memory_first(manifests[0] if manifests else None, written)
        if loaded is not None:
            return loaded
    if manifests:
        _check_same_view(store, ctx, manifests[0].step)
    for manifest in manifests:
        started = time.perf_counter()
        if mode == "broadcast" and ctx.initialized and ctx.world_size > 1:
            outcome = _load_broadcast(store, ctx, manifest)
        else:
            outcome = load_here(store, manifest, written.in_place)
        worst = written.agree(outcome.status)
        if worst == Status.OK:
            assert outcome.loaded is not None
            if ctx.is_writer:
                log.info("snapshot.discovered", snapshot_step=manifest.step,
                         size_bytes=outcome.loaded.size_bytes, restore_mode=mode,
                         tier="durable", duration_s=round(time.perf_counter() - started, 4))
            return outcome.loaded
        if worst == Status.CORRUPT:
            if outcome.error is not None:
                log.warning("snapshot.corrupt", snapshot_step=manifest.step,
                            reason=str(outcome.error),
                            action="skipped, trying the previous snapshot")
            continue
        if outcome.status > Status.CORRUPT and outcome.error is not None:
            raise outcome.error  # this rank's own failure says most
        raise _peer_error(worst, store, manifest.step)
    if written.anywhere:
        raise RestoreOverwrote(
            f"{store.url}: no committed snapshot verifies (each was logged as "
            "snapshot.corrupt), and one was already read into the model's tensors, so this "
            "process cannot start fresh from the model's initial values; nothing was "
            f"deleted; fix: list them with `elastictrain snapshots verify {store.url}`, "
            "then move the corrupt step directories aside to start fresh")
    return None


def _discover(store: Store, ctx: DistContext) -> list[Manifest]:
    """Rank 0's committed manifests, newest first, on every rank. Directories without
    a valid manifest are logged as ``snapshot.corrupt`` and left out."""
    found: list[Manifest] = []
    error: Exception | None = None
    if ctx.is_writer:
        try:
            for candidate in newest_first(store):
                if candidate.manifest is not None:
                    found.append(candidate.manifest)
                else:
                    log.warning("snapshot.corrupt", snapshot_step=candidate.step,
                                reason=candidate.problem,
                                action="skipped, trying the previous snapshot")
        except Exception as exc:  # every rank must learn of it, or the others hang
            error = exc
    shared: tuple[list[Manifest], str | None] = ctx.broadcast_object(
        (found, None if error is None else str(error)))
    if error is not None:
        raise error
    if shared[1] is not None:
        raise StorageError(f"rank 0 could not list the snapshots under {store.url} "
                           f"({shared[1]}); torchrun retries the attempt")
    return shared[0]


def _check_same_view(store: Store, ctx: DistContext, newest: int) -> None:
    """Every rank must see rank 0's newest manifest: with node-local storage on several
    nodes the others would otherwise skip it as missing and start elsewhere.

    A file system is what a node's ranks share, so one rank per node looks (local rank
    0), not every rank: N requests on one object would be N² over N restores. An object
    store is one namespace for every node, so nobody looks there."""
    if not ctx.initialized or ctx.world_size == 1 or store.local_path(layout.SNAPSHOTS) is None:
        return
    error: Exception | None = None
    seen = True
    if not ctx.is_writer and ctx.local_rank == 0:
        try:
            seen = is_committed(store, newest)
        except Exception as exc:
            error = exc
    blind_rank, failed = ctx.all_reduce_max([0 if seen else ctx.rank + 1,
                                             int(error is not None)])
    if error is not None:
        raise error
    if failed:
        raise StorageError(f"another rank could not read {store.url} (its log says why); "
                           "torchrun retries the attempt")
    if blind_rank:
        raise ConfigError(
            f"rank {blind_rank - 1} does not see snapshots under {store.url} that rank 0 sees "
            f"(step {newest}; node-local storage on a multi-node job?); fix: use shared "
            "storage (NFS, S3) that every node reads, or copy the snapshots to every node")


def load_here(store: Store, manifest: Manifest, in_place: InPlace | None = None) -> Outcome:
    """Read, verify and deserialize on this rank; never raises (peers must agree first)."""
    try:
        found = verify_snapshot(store, manifest.step, manifest=manifest, load=True,
                                in_place=in_place)
    except SnapshotCorrupt as exc:
        return Outcome(Status.CORRUPT, error=exc)
    except SnapshotUnloadable as exc:
        return Outcome(Status.UNLOADABLE, error=exc)
    except Exception as exc:
        return Outcome(Status.FAILED, error=exc)
    assert found.payload is not None
    return Outcome(Status.OK, LoadedSnapshot(manifest.step, found.payload,
                                               manifest.total_bytes))


def _load_broadcast(store: Store, ctx: DistContext, manifest: Manifest) -> Outcome:
    """Rank 0 loads and verifies; the others receive its storages (few: one per slab),
    and each rank its own RNG state (``scatter_rng``)."""
    index = StorageIndex()
    header: tuple[Status, str | None, Any, list[int]] = (Status.OK, None, None, [])
    outcome = Outcome(Status.OK)
    rng: list[Any] | None = None
    if ctx.is_writer:
        outcome = load_here(store, manifest)
        if outcome.loaded is not None:
            rest = dict(outcome.loaded.payload)
            rng = rest.pop("rng")
            skeleton = to_views(rest, index)
            header = (Status.OK, None, skeleton, [s.nbytes() for s in index.storages])
        else:
            header = (outcome.status, str(outcome.error), None, [])
    status, reason, skeleton, sizes = ctx.broadcast_object(header)
    if ctx.is_writer and status != Status.OK:
        return outcome
    if status != Status.OK:
        # Only rank 0 logs the corruption it found; the others raise what it raised.
        return Outcome(status, error=None if status == Status.CORRUPT
                        else _peer_error(status, store, manifest.step, reason))
    if ctx.is_writer:
        storages = [as_bytes(s) for s in index.storages]
    else:
        storages = [as_bytes(torch.UntypedStorage(n)) for n in sizes]
    for tensor in storages:
        ctx.broadcast_tensor(tensor)
    payload = from_views(skeleton, dict(enumerate(storages)))
    shared = scatter_rng(ctx, rng)
    payload["rng"] = rng if rng is not None else shared
    return Outcome(Status.OK, LoadedSnapshot(manifest.step, payload, manifest.total_bytes))


def scatter_rng(ctx: DistContext, rng: list[Any] | None) -> list[Any]:
    """Each rank's view of the saved RNG states (one per saving rank): rank 0's, which
    seeds every rank when the world size changed, and its own; the others None. A
    broadcast would send every rank all N states (N² in all) to use one or two."""
    shares = None
    if rng is not None:
        first = _detached(rng[0]) if rng else None
        shares = [(len(rng), first, _detached(rng[r]) if 0 < r < len(rng) else None)
                  for r in range(ctx.world_size)]
    saved, first, own = ctx.scatter_object(shares)
    states: list[Any] = [None] * saved
    if saved:
        states[0] = first
    if 0 < ctx.rank < saved:
        states[ctx.rank] = own
    return states


def _detached(state: Any) -> Any:
    """``state`` with each tensor copied out of the loaded slab it views: pickled as a
    view, a tensor would carry its whole storage along."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _detached(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_detached(v) for v in state)
    return state


def _peer_error(status: Status, store: Store, step: int,
                reason: str | None = None) -> ElasticTrainError:
    """What a rank raises when another rank failed to load ``step``."""
    why = f": {reason}" if reason else " (its log says why)"
    where = f"{store.url}/{layout.step_dir(step)}"
    if status == Status.UNLOADABLE:
        return SnapshotUnloadable(f"{where}: another rank cannot deserialize the snapshot{why}")
    return StorageError(f"{where}: another rank could not read the snapshot{why}; no rank "
                        "resumes alone, torchrun retries the attempt")
