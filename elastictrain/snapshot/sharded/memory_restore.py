"""Restore of sharded state from the nodes' memory (docs/memory-tier.md, "Sharded
(FSDP2/DTensor) state").

Call order (every rank)::

    (rank 0)  the newest committed durable step → broadcast
    (leaders) what this node holds newer than it, each object verified (memory_node)
    (all)     one all-gather → ``memory_node.choose``: the newest step every object of
              which some live node holds, and which node sends each missing object
    (leaders) holder → lacking node, point to point on the snapshot transport, in one
              order every rank computes; each object checked against the manifest on
              arrival, then HELD.json and the manifest (last) rewritten; one all-reduce
    (all)     the sharded restore of that step from each rank's own node directory
              (every object verified again as DCP reads it; resharding as usual)

Every node ends up holding the whole step (each node's memory holds the full state
once, besides what it held). Anything that fails means the durable restore on every
rank, with the reason in ``snapshot.memory_skipped``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import nn

from elastictrain.core import layout
from elastictrain.core.errors import SnapshotCorrupt, SnapshotUnloadable, StorageError
from elastictrain.core.log import get_logger
from elastictrain.snapshot.durable.restore import LoadedSnapshot
from elastictrain.snapshot.format.commitmark import commit_in_place, is_committed, read_marker
from elastictrain.snapshot.format.manifest import Manifest
from elastictrain.snapshot.format.reader import list_snapshot_dirs
from elastictrain.snapshot.memory.peer_restore import receive_object
from elastictrain.snapshot.memory.peer_transport import (
    NodeMap,
    PeerTransport,
    recv_json,
    send_json,
)
from elastictrain.snapshot.sharded.memory_node import (
    NO_STEP,
    Choice,
    choose,
    holdings,
    read_held,
    write_held,
)
from elastictrain.snapshot.sharded.restore import load_newest_sharded
from elastictrain.storage.api import Store
from elastictrain.worker.dist import DistContext

log = get_logger("elastictrain.snapshot")

TAG_FETCH = 14  # apart from peer_transport's tags and the save's exchange
CHUNK_BYTES = 16 << 20


class ShardedMemory:
    """The memory tier of a sharded model at restore.

    Args:
        store: this node's memory directory (every rank of the node opens it).
        nodes: which rank is on which node.
        transport: the snapshot transport between nodes; None when nothing may cross
            nodes (``memory_replicas = 0`` or one node).
    """

    def __init__(self, store: Store, ctx: DistContext, nodes: NodeMap,
                 transport: PeerTransport | None) -> None:
        self.store, self.ctx, self.nodes, self.transport = store, ctx, nodes, transport
        self.node = nodes.node_of[ctx.rank]
        self.leader = ctx.rank == nodes.leader(self.node)
        self.touched = False  # a memory load failed after it changed the model

    def load(self, durable: Store, group: Any | None, model: nn.Module,
             optimizer: Any | None) -> LoadedSnapshot | None:
        """(all ranks) The newest memory step newer than durable, loaded; None (logged)
        when the durable restore must run instead."""
        newest, error = self.ctx.broadcast_object(
            _newest_committed(durable) if self.ctx.is_writer else None)
        durable_step = int(newest)
        if error is not None:  # the durable restore meets the same error on every rank
            return _skipped(durable_step, f"listing durable storage failed: {error}")
        found = self.ctx.all_gather_object(holdings(self.store, durable_step)
                                           if self.leader else None)
        leaders = [self.nodes.leader(n) for n in range(self.nodes.count)]
        choice = choose([list(found[r]) for r in leaders], [True] * self.nodes.count,
                        durable_step, may_transfer=self.transport is not None)
        if choice.reason is not None:
            return _skipped(durable_step, choice.reason)
        problem = self._fetch(choice)
        (failed,) = self.ctx.all_reduce_max([int(problem is not None)])
        if failed:
            return _skipped(durable_step, f"step {choice.step}: a part did not arrive whole "
                            "and verified on some node (its snapshot.memory_received says why)")
        try:
            loaded = load_newest_sharded(self.store, self.ctx, group, model, optimizer,
                                         only=[choice.step])
        except SnapshotCorrupt as exc:  # partly loaded: the durable restore overwrites it all
            self.touched = True
            return _skipped(durable_step, str(exc))
        except (StorageError, SnapshotUnloadable) as exc:
            return _skipped(durable_step, f"{type(exc).__name__}: {exc}")
        if loaded is None:
            return _skipped(durable_step, f"step {choice.step} did not verify")
        return LoadedSnapshot(loaded.step, loaded.payload, loaded.size_bytes, "memory",
                              self.peer_rank(choice))

    def peer_rank(self, choice: Choice) -> int | None:
        """The rank whose node sent this node its first missing object (None: it held
        the whole step)."""
        for receiver, holder, _ in choice.pairs():
            if receiver == self.node:
                return self.nodes.leader(holder)
        return None

    def _fetch(self, choice: Choice) -> str | None:
        """(leaders; the others return None) The objects each node lacks, from their
        holders: blocking sends and receives, every leader walking the same list, so
        the first unfinished pair always has both ends at it."""
        if not self.leader or not choice.fetch:
            return None
        assert self.transport is not None  # choose() fetches only when one may
        problem: str | None = None
        received: set[str] = set()
        manifest_raw: bytes | None = None
        for receiver, holder, names in choice.pairs():
            if holder == self.node:
                send_objects(self.transport, self.store, choice.step, names,
                             self.nodes.leader(receiver))
            elif receiver == self.node:
                raw, got, why = receive_objects(self.transport, self.store, choice.step,
                                                names, self.nodes.leader(holder))
                received |= got
                manifest_raw = manifest_raw or raw
                problem = problem or why
        if problem is None and received:
            problem = _commit_here(self.store, choice.step, received, manifest_raw)
        return problem


def _newest_committed(store: Store) -> tuple[int, str | None]:
    """(rank 0) The newest durable step with a manifest, and the error of a failed
    listing (sent to every rank: none may wait for a broadcast that never comes)."""
    try:
        for step in list_snapshot_dirs(store):
            if is_committed(store, step):
                return step, None
    except StorageError as exc:
        return NO_STEP, f"{type(exc).__name__}: {exc}"
    return NO_STEP, None


def _skipped(durable_step: int, reason: str) -> LoadedSnapshot | None:
    """Log why the memory tier is not used; None (the durable restore runs)."""
    log.info("snapshot.memory_skipped", durable_step=None if durable_step == NO_STEP
             else durable_step, reason=reason, tier="memory",
             action="restoring from durable storage")
    return None


def _commit_here(store: Store, step: int, received: set[str], raw: bytes | None) -> str | None:
    """HELD.json with what arrived, then the manifest (last), when this node lacked it."""
    try:
        write_held(store, step, read_held(store, step) | received)
        if not is_committed(store, step):
            assert raw is not None  # a node lacking the manifest received one
            commit_in_place(store, step, raw, exclusive=False)
    except (StorageError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def send_objects(transport: PeerTransport, store: Store, step: int, names: list[str],
                 dst: int) -> None:
    """This node's manifest of ``step``, then each named object in chunks. A read that
    fails sends zeros for the rest (the receiver's checksum refuses them)."""
    started = time.perf_counter()
    directory = layout.step_dir(step)
    raw = read_marker(store, step)
    manifest = Manifest.from_json(raw, f"{store.url}/{directory}")
    send_json(transport, {"manifest": raw.decode()}, dst, TAG_FETCH)
    sizes = {o.name: o.size_bytes for o in manifest.objects}
    raw_buffer = bytearray(CHUNK_BYTES)
    buffer, view = torch.frombuffer(raw_buffer, dtype=torch.uint8), memoryview(raw_buffer)
    error: str | None = None
    for name in names:
        size, sent = sizes[name], 0
        try:
            with store.open_read(f"{directory}/{name}") as source:
                while sent < size:
                    n = min(CHUNK_BYTES, size - sent)
                    if (source.readinto(view[:n]) or 0) < n:  # type: ignore[attr-defined]
                        raise SnapshotCorrupt(f"{name}: shorter than its manifest")
                    transport.send(buffer[:n], dst, TAG_FETCH)
                    sent += n
        except (StorageError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            buffer.zero_()
            for start in range(sent, size, CHUNK_BYTES):
                transport.send(buffer[:min(CHUNK_BYTES, size - start)], dst, TAG_FETCH)
    (log.warning if error else log.info)(
        "snapshot.memory_sent", snapshot_step=step, to_rank=dst, tier="memory",
        objects=len(names), size_bytes=sum(sizes[n] for n in names), error=error,
        duration_s=round(time.perf_counter() - started, 4))


def receive_objects(transport: PeerTransport, store: Store, step: int, names: list[str],
                    src: int) -> tuple[bytes, set[str], str | None]:
    """Receive ``names`` of ``step`` into this node's directory; each kept only if its
    size and checksum match the manifest. Returns the sender's manifest, the names
    kept, and the problem (None: all arrived verified)."""
    started = time.perf_counter()
    header = recv_json(transport, src, TAG_FETCH)
    raw = str(header["manifest"]).encode()
    manifest = Manifest.from_json(raw, f"memory snapshot of step {step} from rank {src}")
    entries = {o.name: o for o in manifest.objects}
    problem = None if manifest.step == step else f"its manifest says step {manifest.step}"
    kept: set[str] = set()
    raw_buffer = bytearray(CHUNK_BYTES)
    buffer, view = torch.frombuffer(raw_buffer, dtype=torch.uint8), memoryview(raw_buffer)
    directory = layout.step_dir(step)
    for name in names:
        entry = entries[name]
        refused = (None if layout.is_sharded_object(name)
                   else f"object name {name!r} is no part name")
        why = receive_object(transport, store, f"{directory}/{name}", entry,
                             manifest.checksum_algorithm, (buffer, view), src, TAG_FETCH,
                             CHUNK_BYTES, refused)
        if why is None:
            kept.add(name)
        else:
            problem = problem or why
            with contextlib.suppress(StorageError, OSError):
                store.delete(f"{directory}/{name}")
    (log.warning if problem else log.info)(
        "snapshot.memory_received", snapshot_step=step, from_rank=src, tier="memory",
        objects=len(names), size_bytes=sum(entries[n].size_bytes for n in names),
        verified=problem is None, error=problem,
        duration_s=round(time.perf_counter() - started, 4))
    return raw, kept, problem

