"""The memory tier across nodes, in one process: the ring of record buddies, a snapshot
copy and the record stream over an in-process transport (two threads stand for two
ranks)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from elastictrain.core import layout
from elastictrain.snapshot.format.reader import list_snapshot_dirs, verify_snapshot
from elastictrain.snapshot.memory.peer_restore import receive_copy, send_copy
from elastictrain.snapshot.memory.peer_transport import NodeMap
from elastictrain.storage import open_store
from tests.small_job import build, train


def test_nodes_from_keys_and_record_ring() -> None:
    nodes = NodeMap.from_keys(["a", "a", "b", "b", "c", "c"])
    assert nodes.node_of == (0, 0, 1, 1, 2, 2) and nodes.count == 3
    assert [nodes.leader(n) for n in range(3)] == [0, 2, 4]
    # each rank to the rank in its own position on the next node(s) of the ring
    assert [nodes.record_targets(r, 1) for r in range(6)] == [[2], [3], [4], [5], [0], [1]]
    assert nodes.record_sources(0, 1) == [4] and nodes.record_sources(3, 1) == [1]
    assert nodes.record_targets(0, 2) == [2, 4] and nodes.record_sources(0, 2) == [2, 4]
    assert nodes.record_targets(0, 5) == [2, 4]  # never more than the other nodes
    assert NodeMap.from_keys(["a", "a"]).record_targets(0, 1) == []  # one node
    # ranks need not be contiguous per node (keys come in rank order)
    assert NodeMap.from_keys(["b", "a", "b", "a"]).node_of == (0, 1, 0, 1)


class Wire:
    """Point to point between threads of one process: a queue per (src, dst, tag);
    ``end(rank)`` is the transport as rank ``rank`` uses it."""

    def __init__(self) -> None:
        self._queues: dict[tuple[int, int, int], queue.Queue[bytes]] = {}
        self._lock = threading.Lock()

    def queue(self, src: int, dst: int, tag: int) -> queue.Queue[bytes]:
        with self._lock:
            return self._queues.setdefault((src, dst, tag), queue.Queue())

    def end(self, rank: int) -> End:
        return End(self, rank)


class End:
    def __init__(self, wire: Wire, rank: int) -> None:
        self._wire, self._rank = wire, rank

    def send(self, data: torch.Tensor, dst: int, tag: int) -> None:
        self._wire.queue(self._rank, dst, tag).put(bytes(data.view(torch.uint8).numpy()))

    def recv(self, data: torch.Tensor, src: int, tag: int) -> None:
        got = self._wire.queue(src, self._rank, tag).get(timeout=60)
        raw = data.view(torch.uint8)
        assert len(got) == raw.numel()
        raw.copy_(torch.frombuffer(bytearray(got), dtype=torch.uint8))


def _both(send: Callable[[], object], receive: Callable[[], object]) -> object:
    """Run a sender and a receiver in two threads; the receiver's result."""
    results: list[object] = []
    threads = [threading.Thread(target=send, daemon=True),
               threading.Thread(target=lambda: results.append(receive()), daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    return results[0]


def _memory_snapshot(tmp_path: Path, until: int) -> Path:
    parts = build(str(tmp_path / "run"), memory_every=1, memory_dir=str(tmp_path / "mem"))
    train(*parts, until=until)
    parts[4].wait()
    return tmp_path / "mem"


def test_a_copy_arrives_verified_and_committed(tmp_path: Path) -> None:
    held = open_store(str(_memory_snapshot(tmp_path, 7)))
    lacking = open_store(str(tmp_path / "new"))
    wire = Wire()
    assert _both(lambda: send_copy(wire.end(0), held, 7, 1),
                 lambda: receive_copy(wire.end(1), lacking, 7, 0)) is True
    assert list_snapshot_dirs(lacking) == [7]
    assert verify_snapshot(lacking, 7).manifest == verify_snapshot(held, 7).manifest
    assert not [n for n in lacking.list_dir(layout.SNAPSHOTS) if layout.is_partial(n)]


def test_a_corrupt_copy_is_refused_and_nothing_committed(tmp_path: Path) -> None:
    mem = _memory_snapshot(tmp_path, 7)
    payload = mem / layout.step_dir(7) / layout.PAYLOAD
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one bit flipped on the holder's node
    payload.write_bytes(bytes(data))
    lacking = open_store(str(tmp_path / "new"))
    wire = Wire()
    assert _both(lambda: send_copy(wire.end(0), open_store(str(mem)), 7, 1),
                 lambda: receive_copy(wire.end(1), lacking, 7, 0)) is False
    assert list_snapshot_dirs(lacking) == []
    assert not lacking.list_dir(layout.SNAPSHOTS)  # its partial directory removed too


def test_a_missing_copy_says_so_and_commits_nothing(tmp_path: Path) -> None:
    held = open_store(str(_memory_snapshot(tmp_path, 7)))
    lacking = open_store(str(tmp_path / "new"))
    wire = Wire()
    assert _both(lambda: send_copy(wire.end(0), held, 99, 1),  # never taken
                 lambda: receive_copy(wire.end(1), lacking, 99, 0)) is False
    assert list_snapshot_dirs(lacking) == []
