"""Restore from a peer node's memory (docs/memory-tier.md#across-nodes).

Replicated (DDP) state: every memory snapshot holds the whole state and every rank's
RNG states (gathered at save), so any node's copy of a snapshot is every node's copy.
The ranks agree on one snapshot, by its identity (snapshot/memory/memory_choice.py, a pure
function of what each node holds); each node not holding it (none, or another snapshot
of the same step) receives the holder's files over the snapshot transport (its leader
from a holder's leader, holders taken in turn), checks every byte against the manifest
the holder sent, and commits it to its own memory directory as the saver does (a
``.partial-`` directory, the manifest last, one rename). Then every rank loads its own
node's copy as before, verified again on the way. A copy that fails anywhere means the
durable restore (memory is a cache; durable storage the truth).

Call order (every rank)::

    agree:    one all-gather of (newest memory snapshot, has a memory directory) per rank
    fetch:    (leaders) holder → lacking node, point to point; one all-reduce of outcomes
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import BinaryIO

import torch

from elastictrain.core import layout
from elastictrain.core.config import ChecksumAlgorithm
from elastictrain.core.errors import SnapshotCorrupt, StorageError
from elastictrain.core.log import get_logger
from elastictrain.snapshot.format.checksum import new_hasher
from elastictrain.snapshot.format.commitmark import commit_by_rename, read_marker
from elastictrain.snapshot.format.manifest import Manifest, ObjectEntry
from elastictrain.snapshot.memory.memory_choice import Choice, Durable, Held, choose
from elastictrain.snapshot.memory.peer_transport import (
    TAG_COPY,
    NodeMap,
    PeerTransport,
    recv_json,
    send_json,
)
from elastictrain.snapshot.memory.record_links import RecordLinks
from elastictrain.storage.api import Store
from elastictrain.worker.dist import DistContext

log = get_logger("elastictrain.snapshot")

CHUNK_BYTES = 64 << 20  # bytes per message: bounded memory on both ends


class PeerCopies:
    """The memory tier's view of the other nodes at restore: who holds what, and the
    copy of the chosen step to the nodes lacking it."""

    def __init__(self, ctx: DistContext, nodes: NodeMap, transport: PeerTransport,
                 record_links: RecordLinks | None = None) -> None:
        self.ctx, self.nodes, self.transport = ctx, nodes, transport
        # The rescue's connections for boundary records (snapshot/memory/record_links.py).
        self.record_links = record_links if record_links is not None else RecordLinks()

    @property
    def node(self) -> int:
        return self.nodes.node_of[self.ctx.rank]

    def agree(self, held_here: Held, *, can_receive: bool, durable: Durable) -> Choice:
        """(all ranks) ``choose`` over what every node's leader found."""
        found = self.ctx.all_gather_object((held_here, can_receive))
        leaders = [self.nodes.leader(node) for node in range(self.nodes.count)]
        return choose([found[r][0] for r in leaders], [bool(found[r][1]) for r in leaders],
                      durable)

    def source_rank(self, choice: Choice) -> int | None:
        """The rank whose node's copy this node restores (None: its own)."""
        sender = choice.sources.get(self.node)
        return None if sender is None else self.nodes.leader(sender)

    def fetch(self, choice: Choice, store: Store | None) -> bool:
        """(all ranks) Copy ``choice.step`` to every node lacking it; True when every
        copy arrived whole and committed."""
        ok = True
        if self.ctx.rank == self.nodes.leader(self.node):
            for receiver, sender in sorted(choice.sources.items()):
                if sender == self.node:
                    assert store is not None  # a holder has a memory directory
                    send_copy(self.transport, store, choice.step, self.nodes.leader(receiver))
                elif receiver == self.node:
                    assert store is not None  # choose() sends only where one can receive
                    ok = receive_copy(self.transport, store, choice.step,
                                      self.nodes.leader(sender))
        (failed,) = self.ctx.all_reduce_max([int(not ok)])
        return not failed


def send_copy(transport: PeerTransport, store: Store, step: int, dst: int) -> None:
    """Send this node's committed memory snapshot of ``step``: its manifest, then each
    object in chunks. A read that fails after the manifest went sends zeros for the
    rest (the receiver's checksum refuses it): the receiver always gets what the
    manifest announced, so neither end waits for bytes that never come."""
    started = time.perf_counter()
    try:
        raw = read_marker(store, step)
        manifest = Manifest.from_json(raw, f"{store.url}/{layout.step_dir(step)}")
    except Exception as exc:
        send_json(transport, {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}, dst, TAG_COPY)
        log.warning("snapshot.memory_sent", snapshot_step=step, to_rank=dst, tier="memory",
                    error=str(exc)[:300])
        return
    send_json(transport, {"manifest": raw.decode()}, dst, TAG_COPY)
    error: str | None = None
    buffer, view = _buffer(manifest)
    for entry in manifest.objects:
        path = f"{layout.step_dir(step)}/{entry.name}"
        sent = 0
        try:
            with store.open_read(path) as f:
                while sent < entry.size_bytes:
                    n = min(CHUNK_BYTES, entry.size_bytes - sent)
                    got = f.readinto(view[:n])  # type: ignore[attr-defined]
                    if (got or 0) < n:
                        raise SnapshotCorrupt(f"{store.url}/{path}: shorter than its manifest")
                    transport.send(buffer[:n], dst, TAG_COPY)
                    sent += n
        except (SnapshotCorrupt, OSError, StorageError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            _send_zeros(transport, buffer, entry.size_bytes - sent, dst)
    (log.warning if error else log.info)(
        "snapshot.memory_sent", snapshot_step=step, to_rank=dst, tier="memory",
        size_bytes=manifest.total_bytes, error=error,
        duration_s=round(time.perf_counter() - started, 4))


def _buffer(manifest: Manifest) -> tuple[torch.Tensor, memoryview]:
    """One chunk's buffer, as a tensor (the transport's) and as bytes (the files')."""
    largest = max((o.size_bytes for o in manifest.objects), default=1)
    raw = bytearray(max(1, min(CHUNK_BYTES, largest)))
    return torch.frombuffer(raw, dtype=torch.uint8), memoryview(raw)


def _send_zeros(transport: PeerTransport, buffer: torch.Tensor, left: int, dst: int) -> None:
    buffer.zero_()
    for start in range(0, left, CHUNK_BYTES):
        transport.send(buffer[:min(CHUNK_BYTES, left - start)], dst, TAG_COPY)


def receive_copy(transport: PeerTransport, store: Store, step: int, src: int) -> bool:
    """Receive a peer's memory snapshot of ``step`` and commit it here, only if every
    object matches the manifest's size and checksum; True when committed."""
    started = time.perf_counter()
    header = recv_json(transport, src, TAG_COPY)
    where = f"memory snapshot of step {step} from rank {src}"
    if "error" in header:
        log.warning("snapshot.memory_received", snapshot_step=step, from_rank=src,
                    tier="memory", verified=False, error=str(header["error"]))
        return False
    raw = str(header["manifest"]).encode()
    manifest = Manifest.from_json(raw, where)  # the sender parsed it: it parses here
    partial = layout.partial_dir(step, uuid.uuid4().hex[:12])
    problem = None if manifest.step == step else f"its manifest says step {manifest.step}"
    buffer, view = _buffer(manifest)
    for entry in manifest.objects:
        refused = None if layout.is_payload(entry.name) else (
            f"object name {entry.name!r} is no payload name")
        problem = receive_object(transport, store, f"{partial}/{entry.name}", entry,
                                 manifest.checksum_algorithm, (buffer, view), src, TAG_COPY,
                                 CHUNK_BYTES, refused) or problem
    if problem is None:
        try:
            # replace: a copy of this step here is one the agreement set aside
            commit_by_rename(store, partial, step, raw, replace=True)
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        with contextlib.suppress(Exception):  # retention removes partial directories
            store.delete(partial, recursive=True)
    (log.warning if problem else log.info)(
        "snapshot.memory_received", snapshot_step=step, from_rank=src, tier="memory",
        size_bytes=manifest.total_bytes, verified=problem is None, error=problem,
        duration_s=round(time.perf_counter() - started, 4))
    return problem is None


def receive_object(transport: PeerTransport, store: Store, path: str, entry: ObjectEntry,
                   algorithm: ChecksumAlgorithm, buffers: tuple[torch.Tensor, memoryview],
                   src: int, tag: int, chunk_bytes: int,
                   refused: str | None = None) -> str | None:
    """Receive one object the manifest lists (``entry``: its size and checksum) from
    ``src`` into ``path``, hashed on the way, in the sender's messages of
    ``chunk_bytes``; the problem with it, or None. ``refused``: a problem known before
    (its bytes are received and dropped). Every byte announced is received whatever goes
    wrong here: the sender sends it."""
    buffer, view = buffers
    problem = refused
    hasher = new_hasher(algorithm)
    try:
        with contextlib.ExitStack() as stack:
            sink: BinaryIO | None = None
            if problem is None:
                try:
                    sink = stack.enter_context(store.open_write(path))
                except (OSError, StorageError) as exc:
                    problem = f"{type(exc).__name__}: {exc}"
            for start in range(0, entry.size_bytes, chunk_bytes):
                n = min(chunk_bytes, entry.size_bytes - start)
                transport.recv(buffer[:n], src, tag)  # a peer gone: raised
                hasher.update(view[:n])
                if sink is not None:
                    try:
                        sink.write(view[:n])
                    except OSError as exc:  # a full tmpfs: keep receiving, commit nothing
                        problem, sink = f"{type(exc).__name__}: {exc}", None
    except (OSError, StorageError) as exc:  # closing the file (its last bytes) failed
        problem = problem or f"{type(exc).__name__}: {exc}"
    if problem is None and hasher.hexdigest() != entry.checksum:
        problem = (f"{entry.name}: {algorithm} {hasher.hexdigest()} does not match the "
                   f"manifest's {entry.checksum}")
    return problem
