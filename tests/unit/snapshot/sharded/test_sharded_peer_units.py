"""The memory tier for sharded state, in one process: the choice (which step, which
holder sends each missing object), the node-manifest completeness rule, what a node
reports holding (each object verified), and a node receiving the objects it lacks over
an in-process transport (two threads stand for two ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastictrain.core import layout
from elastictrain.snapshot.format.reader import read_manifest
from elastictrain.snapshot.sharded.memory_node import (
    NO_STEP,
    Choice,
    Holding,
    choose,
    complete,
    holdings,
    part_of,
    read_held,
    write_held,
)
from elastictrain.snapshot.sharded.memory_restore import receive_objects, send_objects
from elastictrain.storage import open_store
from tests.small_job import build, train
from tests.unit.snapshot.memory.test_peer_units import Wire, _both

NO = NO_STEP
ALL = ("p0", "p1", "meta", "train")  # rank 0's and rank 1's parts, the small pieces


def held(step: int, *names: str, digest: str = "d") -> Holding:
    return Holding(step, digest, ALL, names)


@pytest.mark.parametrize(("nodes", "receive", "durable", "transfer", "expected"), [
    # every node holds the whole step: nothing crosses nodes
    ([[held(7, *ALL)], [held(7, *ALL)]], [True, True], 5, True, Choice(7, None, {})),
    # a replaced node holds nothing: everything from its buddy
    ([[held(7, *ALL)], []], [True, True], 5, True,
     Choice(7, None, {1: [(n, 0) for n in ALL]})),
    # no replicas on two live nodes: each lacks the other's part; they swap
    ([[held(7, "p0", "meta", "train")], [held(7, "p1", "meta", "train")]], [True, True], 5,
     True, Choice(7, None, {0: [("p1", 1)], 1: [("p0", 0)]})),
    # ... unless nothing may cross nodes (memory_replicas = 0)
    ([[held(7, "p0", "meta", "train")], [held(7, "p1", "meta", "train")]], [True, True], 5,
     False, Choice(NO, "step 7: node 0 lacks 1 of its objects (memory_replicas = 0)", {})),
    # a part that died with its node and had no replica: durable
    ([[held(7, "p0", "meta", "train")], []], [True, True], 5, True,
     Choice(NO, "step 7: no live node holds ['p1']", {})),
    # the newest step is incomplete everywhere, the one before is whole: that one
    ([[held(8, "p0", "meta", "train"), held(7, *ALL)], []], [True, True], 5, True,
     Choice(7, None, {1: [(n, 0) for n in ALL]})),
    # not newer than durable
    ([[held(7, *ALL)], [held(7, *ALL)]], [True, True], 7, True,
     Choice(NO, "no memory snapshot newer than the durable one", {})),
    ([[], []], [True, True], NO, True,
     Choice(NO, "no memory snapshot newer than the durable one", {})),
    # two manifests of one step (never mixed)
    ([[held(7, *ALL)], [held(7, *ALL, digest="e")]], [True, True], 5, True,
     Choice(NO, "step 7: the nodes hold different manifests of it", {})),
    # a lacking node without a memory directory
    ([[held(7, *ALL)], []], [True, False], 5, True,
     Choice(NO, "step 7: node 1 lacks parts and has no memory directory to receive them", {})),
    # holders take turns: two whole nodes, a third lacking all four objects
    ([[held(7, *ALL)], [held(7, *ALL)], []], [True] * 3, NO, True,
     Choice(7, None, {2: [("p0", 0), ("p1", 1), ("meta", 0), ("train", 1)]})),
])
def test_choose(nodes: list[list[Holding]], receive: list[bool], durable: int,
                transfer: bool, expected: Choice) -> None:
    assert choose(nodes, receive, durable, may_transfer=transfer) == expected


def test_pairs_group_each_receiver_and_holder_in_one_order() -> None:
    choice = Choice(7, None, {2: [("p0", 0), ("p1", 1), ("meta", 0)], 1: [("train", 0)]})
    assert choice.pairs() == [(1, 0, ["train"]), (2, 0, ["meta", "p0"]), (2, 1, ["p1"])]


def _memory_snapshot(tmp_path: Path, until: int = 7) -> Path:
    """One process, sharded saver, memory every step, left as a crash leaves it."""
    parts = build(str(tmp_path / "run"), sharded=True, memory_every=1,
                  memory_dir=str(tmp_path / "mem"))
    train(*parts, until=until)
    parts[4].wait()
    return tmp_path / "mem"


def test_a_node_step_is_complete_only_with_every_object(tmp_path: Path) -> None:
    store = open_store(str(_memory_snapshot(tmp_path)))
    manifest = read_manifest(store, 7)
    names = read_held(store, 7)
    assert names == {o.name for o in manifest.objects} and complete(manifest, names)
    part = part_of(manifest, 0)
    assert part is not None
    assert not complete(manifest, names - {part.name})
    (found,) = holdings(store, newer_than=5)
    assert (found.step, set(found.held)) == (7, names)
    assert holdings(store, newer_than=7) == []
    # HELD.json naming fewer objects is what the node reports
    write_held(store, 7, names - {part.name})
    assert part.name not in holdings(store, 5)[0].held


def test_a_corrupt_part_is_not_reported_held(tmp_path: Path) -> None:
    mem = _memory_snapshot(tmp_path)
    store = open_store(str(mem))
    part = part_of(read_manifest(store, 7), 0)
    assert part is not None
    path = mem / layout.step_dir(7) / part.name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    (found,) = holdings(store, 5)
    assert part.name not in found.held and len(found.held) == len(found.names) - 1


def test_a_lacking_node_receives_every_object_verified(tmp_path: Path) -> None:
    holder = open_store(str(_memory_snapshot(tmp_path)))
    lacking = open_store(str(tmp_path / "new"))
    names = sorted(o.name for o in read_manifest(holder, 7).objects)
    wire = Wire()
    raw, kept, problem = _both(  # type: ignore[misc]
        lambda: send_objects(wire.end(0), holder, 7, names, 1),
        lambda: receive_objects(wire.end(1), lacking, 7, names, 0))
    assert (problem, kept) == (None, set(names))
    assert raw == holder.read_bytes(f"{layout.step_dir(7)}/{layout.MANIFEST}")
    for name in names:
        path = f"{layout.step_dir(7)}/{name}"
        assert lacking.read_bytes(path) == holder.read_bytes(path)


def test_a_corrupt_object_is_refused_and_removed(tmp_path: Path) -> None:
    mem = _memory_snapshot(tmp_path)
    holder = open_store(str(mem))
    manifest = read_manifest(holder, 7)
    part = part_of(manifest, 0)
    assert part is not None
    path = mem / layout.step_dir(7) / part.name
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF  # one bit flipped on the holder's node
    path.write_bytes(bytes(data))
    lacking = open_store(str(tmp_path / "new"))
    names = sorted(o.name for o in manifest.objects)
    wire = Wire()
    _, kept, problem = _both(  # type: ignore[misc]
        lambda: send_objects(wire.end(0), holder, 7, names, 1),
        lambda: receive_objects(wire.end(1), lacking, 7, names, 0))
    assert kept == set(names) - {part.name}
    assert problem is not None and part.name in problem
    assert part.name not in lacking.list_dir(layout.step_dir(7))
