"""Async snapshots in one process: thread and process persisters, retries and failures,
back-pressure, flat staging memory, time triggers, and verified loading."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from elastictrain.core import layout
from elastictrain.core.errors import SnapshotCorrupt
from elastictrain.snapshot.durable.commit import persist_snapshot
from elastictrain.snapshot.format.manifest import SnapshotMeta
from elastictrain.snapshot.format.reader import verify_snapshot
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.snapshot.state.rng import capture_rng, restore_rng
from elastictrain.snapshot.state.staging import StagingBuffers
from elastictrain.storage import open_store
from elastictrain.worker.dist import DistContext


@pytest.mark.parametrize("share_memory", [False, True])
def test_staging_memory_is_flat_over_50_saves(share_memory: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters())
    staging = StagingBuffers(share_memory=share_memory)
    sizes, allocations, pointers = set(), set(), set()
    for _ in range(50):
        model(torch.randn(2, 32)).sum().backward()
        opt.step()
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        staged = staging.stage(state)
        sizes.add(staging.nbytes)
        allocations.add(staging.allocations)
        pointers.add(staged["model"]["0.weight"].data_ptr())
        assert torch.equal(staged["optimizer"]["state"][0]["exp_avg"],
                           opt.state_dict()["state"][0]["exp_avg"])
        assert staged["model"]["0.weight"].is_shared() == share_memory
    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    assert len(sizes) == 1 and len(allocations) == 1 and len(pointers) == 1
    assert state_bytes <= staging.nbytes <= 1.1 * state_bytes


def _tensors(node: Any) -> list[torch.Tensor]:
    if isinstance(node, torch.Tensor):
        return [node]
    if isinstance(node, dict):
        return [t for v in node.values() for t in _tensors(v)]
    if isinstance(node, (list, tuple)):
        return [t for v in node for t in _tensors(v)]
    return []


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _CountingContext(DistContext):
    agreements = 0

    def all_reduce_max(self, values: list[int]) -> list[int]:
        self.agreements += 1
        return super().all_reduce_max(values)


def _saved_steps(snap: SnapshotManager, clock: _Clock, steps: int, dt: float) -> list[int]:
    saved = []
    for _ in range(steps):
        clock.now += dt
        if snap.step() is not None:
            saved.append(snap.step_count)
    snap.close()
    return saved


@pytest.mark.parametrize("every_steps,expected", [(None, [4, 8, 12]),
                                                  (7, [4, 7, 11, 14])])
def test_time_trigger_with_an_injected_clock(tmp_path: Path, every_steps: int | None,
                                             expected: list[int]) -> None:
    clock = _Clock()
    ctx = _CountingContext(0, 1, 0, "gloo", torch.device("cpu"), False)
    snap = SnapshotManager(str(tmp_path), model=torch.nn.Linear(2, 2), ctx=ctx, clock=clock,
                           every_steps=every_steps, every_seconds=10, persister="thread")
    assert _saved_steps(snap, clock, 14, dt=3.0) == expected  # 3 s per step, every 10 s
    assert ctx.agreements == 14 - sum(1 for s in expected if every_steps and s % every_steps == 0)


def test_step_trigger_alone_never_all_reduces(tmp_path: Path) -> None:
    clock = _Clock()
    ctx = _CountingContext(0, 1, 0, "gloo", torch.device("cpu"), False)
    snap = SnapshotManager(str(tmp_path), model=torch.nn.Linear(2, 2), ctx=ctx, clock=clock,
                           every_steps=5, persister="thread")
    assert _saved_steps(snap, clock, 10, dt=100.0) == [5, 10]
    assert ctx.agreements == 0


def test_restore_rng_from_a_loaded_view_at_an_offset(tmp_path: Path) -> None:
    """Staged RNG states share one slab; rank 1's state sits at an offset in it."""
    rank0 = capture_rng()
    torch.rand(7)
    random.random()
    rank1 = capture_rng()
    expected, expected_py = torch.rand(5), [random.random() for _ in range(3)]
    staged = StagingBuffers().stage({"rng": [rank0, rank1]})
    store = open_store(str(tmp_path))
    persist_snapshot(store, staged, SnapshotMeta("t", 1, 0, 2, "crc32"))
    loaded = verify_snapshot(store, 1, load=True).payload
    assert loaded is not None
    assert loaded["rng"][1]["torch"].storage_offset() > 0
    restore_rng(loaded["rng"][1])
    assert torch.equal(torch.rand(5), expected)
    assert [random.random() for _ in range(3)] == expected_py  # python's, from a tensor


def test_restore_rng_accepts_python_state_as_a_tuple() -> None:
    """Snapshots written before session 7 hold python's RNG words as a tuple of ints."""
    state = capture_rng()
    version, internal, gauss = state["python"]
    expected = [random.random() for _ in range(3)]
    restore_rng({**state, "python": (version, tuple(internal.tolist()), gauss)})
    assert [random.random() for _ in range(3)] == expected


@pytest.mark.parametrize("where", ["first", "early", "middle", "last"])
def test_fused_load_detects_a_flipped_byte_anywhere(tmp_path: Path, where: str) -> None:
    store = open_store(str(tmp_path))
    state = {"a": torch.randn(5000), "b": [torch.arange(100)], "n": 3}
    persist_snapshot(store, StagingBuffers().stage(state), SnapshotMeta("t", 2, 0, 1, "crc32"))
    loaded = verify_snapshot(store, 2, load=True).payload
    assert loaded is not None
    assert torch.equal(loaded["a"], state["a"]) and loaded["n"] == 3
    path = tmp_path / layout.step_dir(2) / layout.PAYLOAD
    data = bytearray(path.read_bytes())
    index = {"first": 0, "early": 200, "middle": len(data) // 2, "last": len(data) - 1}[where]
    data[index] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt, match=r"state\.pt"):
        verify_snapshot(store, 2, load=True)


