"""How node-memory state crosses nodes (docs/memory-tier.md#across-nodes): which rank
lives on which node, and the point-to-point transport the memory tier sends its bytes
over.

A node is the set of ranks sharing one memory directory (same host, same directory):
found once at manager setup with one small all-gather, so no launcher variable
(``GROUP_RANK``) has to be trusted. Nodes are numbered by their lowest rank.

The transport is a separate process group, gloo on host memory, created once by every
rank at setup: snapshot traffic never queues behind (or blocks) the training group's
collectives, and NCCL or any transport with a blocking send and receive of a byte
tensor between two ranks can replace it (``PeerTransport``).
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as torch_dist

from elastictrain.worker.dist import DistContext

# Tags keep kinds of traffic apart on the one group: a restore's copy of a snapshot,
# and a sharded model's parts (snapshot/sharded/memory_save.py). The rescue's boundary
# records travel on connections of their own (snapshot/memory/record_links.py).
TAG_COPY = 11


@dataclass(frozen=True)
class NodeMap:
    """Which node every rank is on. ``node_of[rank]``: nodes numbered 0.. in the order
    of their lowest rank."""

    node_of: tuple[int, ...]

    @classmethod
    def from_keys(cls, keys: list[str]) -> NodeMap:
        """Ranks with the same key (host and memory directory) share a node."""
        numbers: dict[str, int] = {}
        for key in keys:
            numbers.setdefault(key, len(numbers))
        return cls(tuple(numbers[key] for key in keys))

    @property
    def count(self) -> int:
        return len(set(self.node_of))

    def ranks(self, node: int) -> list[int]:
        return [rank for rank, n in enumerate(self.node_of) if n == node]

    def leader(self, node: int) -> int:
        """The rank that speaks for a node in a copy: its lowest (local rank 0 under
        torchrun, the rank that writes its memory snapshots)."""
        return self.ranks(node)[0]

    def record_targets(self, rank: int, replicas: int) -> list[int]:
        """Where ``rank`` sends its boundary records: on each of the next ``replicas``
        nodes of the ring (never its own), the rank in its own position there."""
        node = self.node_of[rank]
        position = self.ranks(node).index(rank)
        targets = []
        for hop in range(1, min(replicas, self.count - 1) + 1):
            there = self.ranks((node + hop) % self.count)
            targets.append(there[position % len(there)])
        return targets

    def record_sources(self, rank: int, replicas: int) -> list[int]:
        """The ranks that send their boundary records to ``rank``."""
        return [src for src in range(len(self.node_of))
                if rank in self.record_targets(src, replicas)]


def node_key(memory_path: str) -> str:
    """What identifies this rank's node: its host and its memory directory."""
    return f"{socket.gethostname()}:{memory_path}"


def discover(ctx: DistContext, memory_path: str) -> NodeMap:
    """Every rank's node (all ranks call it together: one small all-gather)."""
    return NodeMap.from_keys([str(k) for k in ctx.all_gather_object(node_key(memory_path))])


class PeerTransport(Protocol):
    """A blocking send and receive of a CPU byte tensor between two ranks (global
    ranks), with a tag that keeps kinds of traffic apart."""

    def send(self, data: torch.Tensor, dst: int, tag: int) -> None: ...

    def recv(self, data: torch.Tensor, src: int, tag: int) -> None: ...


class GlooTransport:
    """``PeerTransport`` over a gloo process group of its own (host memory)."""

    def __init__(self, group: Any) -> None:
        self._group = group

    @classmethod
    def create(cls) -> GlooTransport:
        """Every rank calls it, in the same order (a collective)."""
        return cls(torch_dist.new_group(backend="gloo"))

    def send(self, data: torch.Tensor, dst: int, tag: int) -> None:
        torch_dist.send(data, dst=dst, group=self._group, tag=tag)

    def recv(self, data: torch.Tensor, src: int, tag: int) -> None:
        torch_dist.recv(data, src=src, group=self._group, tag=tag)


def send_json(transport: PeerTransport, obj: Any, dst: int, tag: int) -> None:
    """A small JSON document (no pickle: what a peer sends is data, never code)."""
    data = json.dumps(obj).encode()
    transport.send(torch.tensor([len(data)], dtype=torch.int64), dst, tag)
    transport.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, tag)


def recv_json(transport: PeerTransport, src: int, tag: int) -> Any:
    size = torch.zeros(1, dtype=torch.int64)
    transport.recv(size, src, tag)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    transport.recv(data, src, tag)
    return json.loads(bytes(data.numpy()))
