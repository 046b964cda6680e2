"""The node-memory tier's part of a restore, asked before durable storage (the
caller hands it to durable/restore.py's ``load_newest`` as ``memory_first``).

Every rank finds its node's newest committed memory snapshot, one collective agrees on
one snapshot by its identity (memory_choice.py: newer than the newest durable one;
every node holds it, or with peers some node does and the nodes not holding it receive
a copy first: peer_restore.py), every rank reads and verifies its node's copy, and one
all-reduce agrees on the outcome. Anything short of "verified everywhere", a read error
included, falls back to the durable loop: durable storage is the source of truth. A
node's copy that failed to read, verify or load is deleted there
(``snapshot.memory_set_aside``): memory is a cache, and a relaunch must not meet it
again. The memory copy is read into the model's tensors only when a durable snapshot
exists to overwrite them if it fails; before the first durable snapshot it is read into
fresh memory and verified first, so a bad copy leaves the model fresh, never unusable.
"""

from __future__ import annotations

import time

from elastictrain.core import layout
from elastictrain.core.errors import StorageError
from elastictrain.core.log import get_logger
from elastictrain.snapshot.durable.restore import (
    LoadedSnapshot,
    Outcome,
    Status,
    Written,
    load_here,
)
from elastictrain.snapshot.format.manifest import Manifest
from elastictrain.snapshot.format.reader import newest_first, read_manifest
from elastictrain.snapshot.memory.memory_choice import NO_STEP, Durable, Held, choose
from elastictrain.snapshot.memory.peer_restore import PeerCopies
from elastictrain.storage.api import Store
from elastictrain.worker.dist import DistContext

log = get_logger("elastictrain.snapshot")


def load_memory(store: Store | None, ctx: DistContext, peers: PeerCopies | None,
                newest_durable: Manifest | None, written: Written) -> LoadedSnapshot | None:
    """The memory snapshot every rank agrees on (memory_choice.py), loaded, when it
    verifies everywhere, else None (logged as ``snapshot.memory_skipped``). Every rank
    calls it, ``store`` None where its node's directory was refused; ``peers``: the
    other nodes, when copies may cross them (peer_restore.py)."""
    started = time.perf_counter()
    durable = Durable.of(newest_durable)
    durable_step = durable.step
    manifest, error = _newest_memory(store) if store is not None else (None, None)
    step = manifest.step if manifest is not None else NO_STEP
    peer_rank: int | None = None
    if peers is None:  # each rank compares its node's copy; none crosses nodes
        found = ctx.all_gather_object(Held.of(manifest))
        reason = choose(found, [False] * len(found), durable, may_transfer=False).reason
    else:
        choice = peers.agree(Held.of(manifest), can_receive=store is not None, durable=durable)
        reason = choice.reason
        if reason is None and choice.sources and not peers.fetch(choice, store):
            if durable_step == NO_STEP:  # every rank alike: fetch agreed on the outcome
                # A fresh start would drop the holder's verified copy with the rest: the
                # job's only snapshot, lost to a failed read. Retry the attempt instead.
                raise StorageError(
                    f"the memory snapshot of step {choice.step} could not be copied to "
                    f"node(s) {sorted(choice.sources)} (snapshot.memory_received says "
                    "why) and no durable snapshot exists yet; the holder keeps its copy "
                    "and torchrun retries the attempt")
            reason = "a copy to a node lacking it failed"
        peer_rank = peers.source_rank(choice) if reason is None else None
        if peer_rank is not None:  # this node holds the copy it just received
            manifest, error = _manifest_of(store, choice.step)
    if reason is not None:
        log.info("snapshot.memory_skipped", memory_step=None if manifest is None else step,
                 durable_step=None if durable_step == NO_STEP else durable_step,
                 reason=reason, error=error)
        return None
    assert store is not None
    # In place only with a durable snapshot to fall back on (module docstring): with
    # none, a copy that fails after its bytes landed would leave no start possible.
    in_place = written.in_place if durable_step != NO_STEP else None
    outcome = (load_here(store, manifest, in_place) if manifest is not None  # each node
               else Outcome(Status.FAILED, error=StorageError(str(error))))  # its own copy
    step = step if manifest is None else manifest.step
    worst = written.agree(outcome.status)
    if worst != Status.OK:
        # A read error is no corruption, but durable storage holds the truth: use it.
        log.warning("snapshot.memory_skipped", memory_step=step, durable_step=durable_step,
                    reason=f"{worst.name.lower()} on some rank",
                    error=None if outcome.error is None else str(outcome.error))
        if outcome.status != Status.OK and manifest is not None:
            _set_aside(store, step, outcome)
        return None
    assert outcome.loaded is not None
    log.info("snapshot.discovered", snapshot_step=step, size_bytes=outcome.loaded.size_bytes,
             restore_mode="each", tier="memory", peer_rank=peer_rank,
             duration_s=round(time.perf_counter() - started, 4))
    return LoadedSnapshot(step, outcome.loaded.payload, outcome.loaded.size_bytes, "memory",
                          peer_rank)


def _manifest_of(store: Store | None, step: int) -> tuple[Manifest | None, str | None]:
    """The manifest of the copy of ``step`` this node just received (never raises)."""
    assert store is not None
    try:
        return read_manifest(store, step), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _set_aside(store: Store, step: int, outcome: Outcome) -> None:
    """Delete this node's memory copy of ``step``, which failed here (after every rank
    has read: the agreement is behind us); never raises, the durable tier goes on."""
    try:
        store.delete(layout.step_dir(step), recursive=True)
        deleted: str | None = None
    except Exception as exc:
        deleted = f"{type(exc).__name__}: {exc}"
    log.warning("snapshot.memory_set_aside", snapshot_step=step, tier="memory",
                status=outcome.status.name.lower(),
                error=None if outcome.error is None else str(outcome.error)[:300],
                action="deleted from this node's memory; the restore goes on from durable "
                "storage (or fresh)" if deleted is None else f"not deleted ({deleted})")


def _newest_memory(store: Store) -> tuple[Manifest | None, str | None]:
    """This node's newest committed memory snapshot (None if none), and the read
    error that hid it, if any (never raised: the durable tier is the fallback)."""
    try:
        for candidate in newest_first(store):
            if candidate.manifest is not None:
                return candidate.manifest, None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return None, None
