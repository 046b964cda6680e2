"""What one node's memory directory holds of a sharded snapshot, and the rule that picks
the step the ranks restore from memory (docs/memory-tier.md#sharded-fsdp2dtensor-state).

A node's step directory holds its own ranks' parts (``rank<R>-<token>.distcp``), the
parts its buddies sent it, and the step's small global pieces (DCP metadata, training
state). ``HELD.json`` names the objects present on this node and ``MANIFEST.json``, the
step's global manifest (every part of every rank, sizes, checksums, writer rank), is
written last: the node's commit. A step is *complete here* when the node holds every
object its manifest names; a restore needs every object held, verified, somewhere
among the live nodes (``choose``), and each node then receives what it lacks.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from elastictrain.core import layout
from elastictrain.core.errors import SnapshotCorrupt, StorageError, StorageNotFoundError
from elastictrain.snapshot.format.checksum import new_hasher
from elastictrain.snapshot.format.commitmark import read_marker
from elastictrain.snapshot.format.manifest import Manifest, ObjectEntry
from elastictrain.snapshot.format.reader import list_snapshot_dirs, read_manifest
from elastictrain.storage.api import Store

HELD = "HELD.json"  # the objects of the step present on this node (before the manifest)
NO_STEP = -1
_READ_CHUNK = 8 << 20


def part_of(manifest: Manifest, rank: int) -> ObjectEntry | None:
    """The part ``rank`` wrote (DCP's writer writes one object per rank), or None.

    Raises:
        SnapshotCorrupt: the manifest names more than one part of that rank.
    """
    found = [o for o in manifest.objects if o.rank == rank and o.name.endswith(".distcp")]
    if len(found) > 1:
        raise SnapshotCorrupt(f"step {manifest.step}: {len(found)} parts of rank {rank}")
    return found[0] if found else None


def complete(manifest: Manifest, held: set[str]) -> bool:
    """Whether a node holding ``held`` holds every object of the step (complete here)."""
    return all(o.name in held for o in manifest.objects)


@dataclass(frozen=True)
class Holding:
    """One step a node holds in memory: its manifest's digest (every node holding the
    step must hold the same manifest), every object it names, and those present here
    and verified (size and checksum)."""

    step: int
    digest: str
    names: tuple[str, ...]
    held: tuple[str, ...]


@dataclass(frozen=True)
class Choice:
    """The step the ranks restore from memory (``NO_STEP`` with a ``reason`` not to), and
    for each node lacking objects of it, which node sends each one (``fetch``)."""

    step: int
    reason: str | None
    fetch: dict[int, list[tuple[str, int]]]  # node -> [(object name, holder node)]

    def pairs(self) -> list[tuple[int, int, list[str]]]:
        """(receiver, holder, names) in one order every rank computes alike."""
        grouped: dict[tuple[int, int], list[str]] = {}
        for receiver, wanted in self.fetch.items():
            for name, holder in wanted:
                grouped.setdefault((receiver, holder), []).append(name)
        return [(r, h, sorted(names)) for (r, h), names in sorted(grouped.items())]


def choose(holdings: list[list[Holding]], can_receive: list[bool], durable_step: int,
           *, may_transfer: bool) -> Choice:
    """The newest step newer than durable whose every object some node holds.

    Args:
        holdings: per node, the steps it holds (``Holding``); [] for a node holding none.
        can_receive: per node, whether it has a memory directory to receive parts into.
        durable_step: the newest durable snapshot's step (``NO_STEP``: none).
        may_transfer: whether parts may cross nodes (``memory_replicas`` > 0): without,
            memory is chosen only when every node holds the whole step itself.
    """
    steps = sorted({h.step for node in holdings for h in node if h.step > durable_step},
                   reverse=True)
    if not steps:
        return Choice(NO_STEP, "no memory snapshot newer than the durable one", {})
    reasons = []
    for step in steps:
        choice, reason = _choose_step(holdings, can_receive, step, may_transfer=may_transfer)
        if choice is not None:
            return choice
        reasons.append(f"step {step}: {reason}")
    return Choice(NO_STEP, "; ".join(reasons), {})


def _choose_step(holdings: list[list[Holding]], can_receive: list[bool], step: int,
                 *, may_transfer: bool) -> tuple[Choice | None, str]:
    of_step = {node: h for node, held in enumerate(holdings) for h in held if h.step == step}
    if len({h.digest for h in of_step.values()}) > 1:
        return None, "the nodes hold different manifests of it"
    names = next(iter(of_step.values())).names
    holders: dict[str, list[int]] = {name: [] for name in names}
    for node, h in sorted(of_step.items()):
        for name in h.held:
            if name in holders:
                holders[name].append(node)
    missing = sorted(name for name, nodes in holders.items() if not nodes)
    if missing:
        return None, f"no live node holds {missing}"
    fetch: dict[int, list[tuple[str, int]]] = {}
    for node in range(len(holdings)):
        held = set(of_step[node].held) if node in of_step else set()
        lacking = [name for name in names if name not in held]
        if not lacking:
            continue
        if not may_transfer:
            return None, f"node {node} lacks {len(lacking)} of its objects (memory_replicas = 0)"
        if not can_receive[node]:
            return None, f"node {node} lacks parts and has no memory directory to receive them"
        # Spread the sending over the holders: the i-th lacking object from the
        # (node + i)-th of its holders.
        fetch[node] = [(name, holders[name][(node + i) % len(holders[name])])
                       for i, name in enumerate(lacking)]
    return Choice(step, None, fetch), ""


def manifest_digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def read_held(store: Store, step: int) -> set[str]:
    """The names ``HELD.json`` lists for ``step`` ({} when absent or unreadable)."""
    try:
        names = json.loads(store.read_bytes(f"{layout.step_dir(step)}/{HELD}"))
    except (StorageError, ValueError):
        return set()
    return {str(n) for n in names} if isinstance(names, list) else set()


def write_held(store: Store, step: int, names: set[str]) -> None:
    store.write_bytes(f"{layout.step_dir(step)}/{HELD}", json.dumps(sorted(names)).encode())


def holdings(store: Store, newer_than: int) -> list[Holding]:
    """(a node's leader) The committed steps newer than ``newer_than`` in this node's
    memory, each with the objects present here whose size and checksum match its
    manifest (each read whole: memory is read at memory speed). A step whose manifest
    does not read counts as not held."""
    found = []
    for step in list_snapshot_dirs(store):
        if step <= newer_than:
            break
        try:
            manifest = read_manifest(store, step)
            raw = read_marker(store, step)
        except StorageError:  # no manifest (never committed here), unreadable, corrupt
            continue
        listed = read_held(store, step)
        held = tuple(o.name for o in manifest.objects
                     if o.name in listed and verified(store, manifest, o))
        found.append(Holding(step, manifest_digest(raw), tuple(o.name for o in manifest.objects),
                             held))
    return found


def verified(store: Store, manifest: Manifest, entry: ObjectEntry) -> bool:
    """Whether ``entry`` is present with its size and checksum (a read error: False)."""
    hasher = new_hasher(manifest.checksum_algorithm)
    size = 0
    try:
        with store.open_read(f"{layout.step_dir(manifest.step)}/{entry.name}") as source:
            while chunk := source.read(_READ_CHUNK):
                hasher.update(chunk)
                size += len(chunk)
    except (StorageNotFoundError, StorageError, OSError):
        return False
    return size == entry.size_bytes and hasher.hexdigest() == entry.checksum
