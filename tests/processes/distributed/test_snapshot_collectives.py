"""Two real processes over gloo: the time trigger is agreed across ranks, and both
restore modes load the same verified snapshot on every rank (skipping a corrupt one
together)."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from elastictrain.core import layout
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.worker.dist import DistContext
from tests.helpers import free_port

pytestmark = pytest.mark.distributed


def _join(tmp_path: Path, fn: Any, *args: Any, timeout: float = 180) -> None:
    """Run ``fn(rank, *args)`` on 2 spawned ranks; kill them by PID if they overrun."""
    ctx = torch_mp.start_processes(fn, args=(str(tmp_path), free_port(), *args), nprocs=2,
                                   join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise AssertionError(f"ranks did not finish within {timeout}s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join()


def _group(rank: int, port: int) -> DistContext:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    return DistContext(rank, 2, rank, "gloo", torch.device("cpu"), True)


class _RankClock:
    """Rank 0's clock runs 3 s per step; rank 1's stands still (clocks disagree)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.now = rank, 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += 3.0 if self.rank == 0 else 0.0


def _time_trigger_rank(rank: int, tmp: str, port: int) -> None:
    ctx = _group(rank, port)
    clock = _RankClock(rank)
    snap = SnapshotManager(f"{tmp}/run", model=torch.nn.Linear(4, 4), ctx=ctx, clock=clock,
                           every_steps=None, every_seconds=10)
    saved = []
    for _ in range(14):
        clock.tick()
        if snap.step() is not None:
            saved.append(snap.step_count)
    snap.close()
    Path(f"{tmp}/saved-{rank}.json").write_text(json.dumps(saved))
    dist.destroy_process_group()


def test_time_trigger_is_agreed_across_ranks(tmp_path: Path) -> None:
    _join(tmp_path, _time_trigger_rank)
    saved = [json.loads((tmp_path / f"saved-{r}.json").read_text()) for r in (0, 1)]
    assert saved[0] == saved[1] == [4, 8, 12]  # rank 1's clock never says "due"
    # close() saved the last step, 14; keep=3 pruned 4.
    assert sorted(p.name for p in (tmp_path / "run" / layout.SNAPSHOTS).iterdir()) == [
        "step_000000000008", "step_000000000012", "step_000000000014"]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, snap: SnapshotManager,
           until: int) -> None:
    while snap.step_count < until:
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        snap.step()


def _restore_rank(rank: int, tmp: str, port: int) -> None:
    ctx = _group(rank, port)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    snap = SnapshotManager(f"{tmp}/run", model=model, optimizer=opt, ctx=ctx, every_steps=5)
    random.seed(rank)  # a python RNG stream of its own per rank
    _train(model, opt, snap, until=5)
    expected = [p.detach().clone() for p in model.parameters()]
    expected_rng = random.getstate()  # as the save of step 5 captured it
    _train(model, opt, snap, until=10)
    snap.close()
    ctx.barrier()
    if rank == 0:  # damage the newest snapshot: every rank must skip it together
        payload = Path(tmp) / "run" / layout.step_dir(10) / layout.PAYLOAD
        payload.write_bytes(payload.read_bytes()[:-10])
    ctx.barrier()
    results = {}
    for mode in ("each", "broadcast"):
        torch.manual_seed(1)
        fresh = torch.nn.Linear(8, 8)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        again = SnapshotManager(f"{tmp}/run", model=fresh, optimizer=fresh_opt, ctx=ctx,
                                restore_mode=mode)
        info = again.restore()
        results[mode] = {
            "from_step": info.from_step,
            "params_equal": all(torch.equal(a, b) for a, b in zip(fresh.parameters(), expected,
                                                                  strict=True)),
            "adam_step": float(fresh_opt.state_dict()["state"][0]["step"]),
            "own_rng": random.getstate() == expected_rng,
        }
        random.seed(-1)  # the next mode must restore it again
    Path(f"{tmp}/restore-{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_both_restore_modes_load_the_newest_verified_snapshot_everywhere(tmp_path: Path) -> None:
    _join(tmp_path, _restore_rank)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"restore-{rank}.json").read_text())
        for mode in ("each", "broadcast"):
            assert results[mode] == {"from_step": 5, "params_equal": True, "adam_step": 5.0,
                                     "own_rng": True}, (rank, mode)


def _object_collectives(rank: int, root: str, port: int) -> None:
    from elastictrain.worker import dist as et_dist

    ctx = _group(rank, port)
    # Objects of different sizes per rank (padding), a tensor inside, and a broadcast.
    mine = {"rank": rank, "blob": "x" * (10 + 5000 * rank), "t": torch.arange(3) + rank}
    held = []  # after each collective: whether gloo's thread still holds a tensor of it

    def released() -> None:
        held.append(any(map(et_dist._held, et_dist._handed)))

    gathered = ctx.all_gather_object(mine)
    released()
    told = ctx.broadcast_object({"from": rank, "steps": list(range(100))} if rank == 1
                                else None, src=1)
    released()
    assert ctx.all_reduce_max([rank, 7 - rank]) == [1, 7]
    released()
    assert ctx.all_reduce_max([rank, 7 - rank], timeout_s=60) == [1, 7]
    released()
    # To rank 1 only, with an agreement carried along: rank 0 receives nothing.
    to_one, agreed = ctx.gather_object(mine, dst=1, agree=[rank, 7 - rank])
    released()
    # From rank 1, each rank its own object.
    own = ctx.scatter_object([{"to": r, "blob": "y" * (3 + 4000 * r)} for r in range(2)]
                             if rank == 1 else None, src=1)
    released()
    # Each returns only once gloo's thread let go, so a DDP model freed after torch's
    # own destroy_process_group never waits on that thread with the GIL held.
    assert held == [False] * 6, held
    et_dist.destroy_process_group()  # quiesce, then tear down
    assert len(et_dist._handed) == 0  # the backend let go of every tensor it was given
    Path(root, f"rank{rank}.json").write_text(json.dumps({
        "ranks": [g["rank"] for g in gathered], "blobs": [len(g["blob"]) for g in gathered],
        "t": [g["t"].tolist() for g in gathered], "told": told,
        "to_one": None if to_one is None else [len(g["blob"]) for g in to_one],
        "agreed": agreed, "own": [own["to"], len(own["blob"])]}))


def test_object_collectives_round_trip_and_release_their_tensors(tmp_path: Path) -> None:
    """The object collectives elastictrain runs on tensors it keeps (so that no gloo
    thread needs the GIL at exit) give every rank the same objects."""
    _join(tmp_path, _object_collectives)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"ranks": [0, 1], "blobs": [10, 5010], "t": [[0, 1, 2], [1, 2, 3]],
                       "told": {"from": 1, "steps": list(range(100))},
                       "to_one": [10, 5010] if rank == 1 else None, "agreed": [1, 7],
                       "own": [rank, 3 + 4000 * rank]}
