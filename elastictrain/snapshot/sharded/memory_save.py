"""Sharded memory snapshots, replicated to buddy nodes (docs/memory-tier.md, "Sharded
(FSDP2/DTensor) state").

Every rank saves its shards through the sharded saver (DCP, reused staging) into its
node's memory directory. Nothing commits inside DCP's finish; instead, in the
background, once every part is written (call order, every rank, on the saver's own
gloo group)::

    broadcast   rank 0 → all: the step's manifest, DCP metadata, training state (small)
    exchange    each rank's part → the rank at its position on the next
                ``memory_replicas`` nodes (``NodeMap.record_targets``), in chunks,
                checksummed on arrival against the manifest
    all-gather  every rank's outcome and the objects it holds; then each node's leader
                writes the metadata, training state, HELD.json and MANIFEST.json last
                (atomic writes), and keeps one step (``keep=1``: the older one goes only
                once the newer one committed here)

Training waits only for staging (and for the previous save, as back-pressure). A node
whose exchange failed commits nothing for that step and keeps its older one.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from concurrent.futures import Future
from typing import Any, BinaryIO

import torch
import torch.distributed as torch_dist
from structlog.contextvars import bound_contextvars
from torch import nn

from elastictrain.core import layout
from elastictrain.core.errors import SnapshotWriteFailed, StorageError
from elastictrain.core.log import get_logger
from elastictrain.snapshot.durable.persister import SaveHandle, SaveState
from elastictrain.snapshot.durable.retention import prune
from elastictrain.snapshot.durable.saver_interface import SaverSettings
from elastictrain.snapshot.format.checksum import new_hasher
from elastictrain.snapshot.format.commitmark import commit_in_place
from elastictrain.snapshot.format.manifest import Manifest, ObjectEntry, SnapshotMeta
from elastictrain.snapshot.memory.peer_transport import NodeMap
from elastictrain.snapshot.sharded.commit import (
    sharded_manifest,
)
from elastictrain.snapshot.sharded.dcp_io import RankPart
from elastictrain.snapshot.sharded.memory_node import part_of, write_held
from elastictrain.snapshot.sharded.save import ShardedSaver
from elastictrain.storage.api import Store
from elastictrain.worker.dist import DistContext

log = get_logger("elastictrain.snapshot")

CHUNK_BYTES = 16 << 20  # per message: (1 + sources) buffers of this size per rank
TAG_PARTS = 13  # apart from peer_transport's TAG_COPY


class ShardedMemorySaver(ShardedSaver):
    """The sharded saver of the memory tier: every rank, its node's memory directory.

    Args:
        nodes: which rank is on which node.
        replicas: how many other nodes receive each rank's part (0: none).
    """

    def __init__(self, store: Store, settings: SaverSettings, ctx: DistContext,
                 model: nn.Module, optimizer: Any | None, nodes: NodeMap,
                 replicas: int) -> None:
        super().__init__(store, settings, ctx, model, optimizer)
        self.tier = "memory"
        self._nodes, self._replicas = nodes, replicas
        self._global: tuple[bytes, bytes, bytes] | None = None  # (rank 0) the step's pieces
        # Per save: (step, bytes this rank sent, seconds its exchange took) (benchmarks).
        self.replications: list[tuple[int, int, float]] = []

    def _commit_parts(self, meta: SnapshotMeta, token: str, parts: list[RankPart],
                      metadata_bytes: bytes, train_bytes: bytes,
                      started: float) -> Manifest | None:
        """(rank 0, inside DCP's finish) No commit here: keep the step's pieces for the
        broadcast that follows (each node commits its own directory)."""
        manifest = sharded_manifest(meta, token, parts, metadata_bytes, train_bytes)
        self._global = (manifest.to_json(), metadata_bytes, train_bytes)
        return None

    def _log_staged(self, step: int, started: float) -> None:
        with bound_contextvars(tier="memory"):
            super()._log_staged(step, started)

    def _finished(self, handle: SaveHandle, future: Future[Any], meta: SnapshotMeta,
                  committed: list[Manifest | None], started: float) -> None:
        if future.exception() is not None:
            with bound_contextvars(tier="memory"):
                super()._finished(handle, future, meta, committed, started)
            return
        # Never on the training thread (a DCP save that finished before its callback was
        # added calls it there): the exchange runs in a thread of its own.
        context = contextvars.copy_context()
        threading.Thread(target=context.run, args=(self._replicate, handle, meta, started),
                         daemon=True, name="elastictrain-memory-replicate").start()

    def _replicate(self, handle: SaveHandle, meta: SnapshotMeta, started: float) -> None:
        try:
            with bound_contextvars(tier="memory"):
                problem = self._replicate_and_commit(meta, started)
        except Exception as exc:  # a peer gone mid-exchange: this step is not committed
            problem = f"{type(exc).__name__}: {str(exc)[:300]}"
        if problem is None:
            handle._finish(SaveState.COMMITTED)
            return
        log.warning("snapshot.memory_failed", snapshot_step=meta.step, error=problem,
                    tier="memory")
        handle._finish(SaveState.FAILED, error=SnapshotWriteFailed(
            f"memory snapshot of step {meta.step}: {problem}"))

    def _replicate_and_commit(self, meta: SnapshotMeta, started: float) -> str | None:
        """Every rank: the broadcast, the exchange, the node's commit; the problem (None:
        this node committed the step)."""
        rank = self._ctx.rank
        pieces = self._global if rank == 0 else None
        self._global = None
        box: list[Any] = [pieces]
        if self._ctx.initialized:
            torch_dist.broadcast_object_list(box, src=0, group=self._group)
        if box[0] is None:
            return "rank 0 has no manifest of this step"
        raw, metadata_bytes, train_bytes = box[0]
        manifest = Manifest.from_json(raw, f"memory snapshot of step {meta.step}")
        targets = self._nodes.record_targets(rank, self._replicas)
        sources = self._nodes.record_sources(rank, self._replicas)
        exchange_started = time.perf_counter()
        try:
            received, problem, sent = exchange_parts(self._group, self.counted_store, manifest,
                                                     rank, targets, sources)
        except (StorageError, OSError) as exc:  # still reach the all-gather below
            received, problem, sent = [], f"{type(exc).__name__}: {exc}", 0
        exchange_s = time.perf_counter() - exchange_started
        self.replications.append((meta.step, sent, exchange_s))
        fields = {"snapshot_step": meta.step, "to_ranks": targets, "from_ranks": sources,
                  "bytes_sent": sent, "error": problem, "duration_s": round(exchange_s, 4)}
        if problem is not None:
            log.warning("snapshot.memory_replicated", **fields)
        elif targets or sources:
            log.info("snapshot.memory_replicated", **fields)
        own = part_of(manifest, rank)
        mine = (self._nodes.node_of[rank], problem,
                [e.name for e in ([own] if own is not None else [])] + received)
        rows: list[Any] = [None] * self._ctx.world_size
        if self._ctx.initialized:
            torch_dist.all_gather_object(rows, mine, group=self._group)
        else:
            rows = [mine]
        node = self._nodes.node_of[rank]
        if rank != self._nodes.leader(node):
            return problem
        mates = [row for row in rows if row[0] == node]
        failed = [row[1] for row in mates if row[1] is not None]
        if failed:
            return "; ".join(failed)
        held = {name for row in mates for name in row[2]}
        return self._commit_node(manifest, raw, metadata_bytes, train_bytes, held, started)

    def _commit_node(self, manifest: Manifest, raw: bytes, metadata_bytes: bytes,
                     train_bytes: bytes, held: set[str], started: float) -> str | None:
        """(a node's leader) The step's small pieces, HELD.json, then the manifest."""
        step = manifest.step
        directory = layout.step_dir(step)
        token_names = {o.name for o in manifest.objects if not o.name.endswith(".distcp")}
        try:
            for name, data in ((_one(token_names, "dcp-"), metadata_bytes),
                               (_one(token_names, "train-"), train_bytes)):
                self.counted_store.write_bytes(f"{directory}/{name}", data)
                held.add(name)
            write_held(self.counted_store, step, held)
            commit_in_place(self.counted_store, step, raw, exclusive=False)
        except (StorageError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
        duration = round(time.perf_counter() - started, 4)
        log.info("snapshot.committed", snapshot_step=step, size_bytes=manifest.total_bytes,
                 duration_s=duration, attempts=1, ranks=manifest.world_size,
                 objects_here=len(held), objects=len(manifest.objects))
        try:
            prune(self.counted_store, 1, step)
        except Exception as exc:  # committed; retention retries next time
            log.warning("snapshot.prune_failed", snapshot_step=step, error=str(exc),
                        error_type=type(exc).__name__)
        return None


def _one(names: set[str], prefix: str) -> str:
    found = [n for n in names if n.startswith(prefix)]
    assert len(found) == 1, (prefix, names)  # sharded_manifest names exactly one
    return found[0]


def exchange_parts(group: Any, store: Store, manifest: Manifest, rank: int,
                   targets: list[int], sources: list[int],
                   chunk: int = CHUNK_BYTES) -> tuple[list[str], str | None, int]:
    """Send this rank's part to ``targets`` and receive each source's part into this
    node's step directory, chunk by chunk (every rank posts its receives, then its
    sends, and waits for both: no order between ranks can deadlock). Every byte the
    manifest announces is sent and received whatever fails here (a read error sends
    zeros, which the receiver's checksum refuses), so no peer waits for bytes that
    never come. Returns the names received and verified, the problem, bytes sent."""
    directory = layout.step_dir(manifest.step)
    incoming = {s: e for s in sources if (e := part_of(manifest, s)) is not None}
    problem: str | None = None
    received: list[str] = []
    sent = 0
    try:
        sent, problem = _stream(group, store, manifest, rank, targets, incoming, chunk)
    except (StorageError, OSError) as exc:  # closing a received file (its last bytes) failed
        problem = f"{type(exc).__name__}: {exc}"
        incoming_ok: set[int] = set()
    else:
        incoming_ok = set(incoming)
    for s, entry in incoming.items():
        if s in incoming_ok and problem is None:
            received.append(entry.name)
            continue
        with contextlib.suppress(StorageError, OSError):
            store.delete(f"{directory}/{entry.name}")
    return received, problem, sent


def _stream(group: Any, store: Store, manifest: Manifest, rank: int, targets: list[int],
            incoming: dict[int, ObjectEntry], chunk: int) -> tuple[int, str | None]:
    """The chunked exchange of ``exchange_parts``: bytes sent, and the problem."""
    directory = layout.step_dir(manifest.step)
    own = part_of(manifest, rank) if targets else None
    problem: str | None = None
    sent = 0
    with contextlib.ExitStack() as stack:
        source: BinaryIO | None = None
        if own is not None:
            try:
                source = stack.enter_context(store.open_read(f"{directory}/{own.name}"))
            except (StorageError, OSError) as exc:
                problem = f"reading own part: {type(exc).__name__}: {exc}"
        sinks: dict[int, BinaryIO | None] = {}
        hashers = {s: new_hasher(manifest.checksum_algorithm) for s in incoming}
        for s, entry in incoming.items():
            sinks[s] = None
            if not layout.is_sharded_object(entry.name):
                problem = f"rank {s}'s part is named {entry.name!r}"
                continue
            try:
                sinks[s] = stack.enter_context(store.open_write(f"{directory}/{entry.name}"))
            except (StorageError, OSError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
        send_raw = bytearray(min(chunk, max(1, own.size_bytes if own else 1)))
        send_buf, send_view = torch.frombuffer(send_raw, dtype=torch.uint8), memoryview(send_raw)
        recv: dict[int, tuple[torch.Tensor, memoryview]] = {}
        for s, entry in incoming.items():
            raw = bytearray(min(chunk, max(1, entry.size_bytes)))
            recv[s] = (torch.frombuffer(raw, dtype=torch.uint8), memoryview(raw))
        largest = max([own.size_bytes if own else 0, *(e.size_bytes for e in incoming.values())])
        for offset in range(0, largest, chunk):
            works = []
            for s, entry in incoming.items():
                n = min(chunk, entry.size_bytes - offset)
                if n > 0:
                    works.append(torch_dist.irecv(recv[s][0][:n], src=s, group=group,
                                                  tag=TAG_PARTS))
            n = min(chunk, own.size_bytes - offset) if own is not None else 0
            if n > 0:
                got = 0
                if source is not None:
                    try:
                        got = source.readinto(send_view[:n]) or 0  # type: ignore[attr-defined]
                    except OSError as exc:
                        problem, source = f"reading own part: {exc}", None
                if got < n:
                    send_buf[got:n].zero_()
                for target in targets:
                    works.append(torch_dist.isend(send_buf[:n], dst=target, group=group,
                                                  tag=TAG_PARTS))
                    sent += n
            for work in works:
                assert work is not None  # None only for a rank outside the group
                work.wait()  # a peer gone: raised (this step commits nowhere it matters)
            for s, entry in incoming.items():
                n = min(chunk, entry.size_bytes - offset)
                if n <= 0:
                    continue
                view = recv[s][1][:n]
                hashers[s].update(view)
                sink = sinks[s]
                if sink is not None:
                    try:
                        sink.write(view)
                    except OSError as exc:  # a full tmpfs: keep receiving, commit nothing
                        problem, sinks[s] = f"{type(exc).__name__}: {exc}", None
        for s, entry in incoming.items():
            if sinks[s] is not None and hashers[s].hexdigest() != entry.checksum:
                problem = f"rank {s}'s part {entry.name} does not match its manifest checksum"
    return sent, problem
