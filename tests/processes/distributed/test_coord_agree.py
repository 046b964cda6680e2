"""Two real ranks over gloo: a failed save is raised on every rank at the same step (or
on none), with and without a per-step collective, and a manager built without ``ctx``
uses the process group (``elastictrain.init``'s, or one initialised by the script)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import elastictrain as et
from elastictrain.core.config import PreemptConfig
from elastictrain.core.errors import SnapshotWriteFailed
from elastictrain.snapshot.format.reader import verify_snapshot
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.snapshot.state.rng import capture_rng
from elastictrain.storage import open_store
from elastictrain.worker import preempt
from tests.fault_stores import FailingStore
from tests.processes.distributed.test_snapshot_collectives import _group, _join

pytestmark = pytest.mark.distributed


def _failing_rank(rank: int, tmp: str, port: int, per_step_collective: bool) -> None:
    ctx = _group(rank, port)
    if per_step_collective:  # preemption on: one small all-reduce every step
        preempt.install(PreemptConfig(signals=[]), poll=False)
    store = FailingStore(open_store(f"{tmp}/run"), failures=10**6)
    torch.manual_seed(0)  # one replica on every rank, as DDP makes it
    snap = SnapshotManager(store, model=torch.nn.Linear(4, 4), ctx=ctx, every_steps=3,
                           max_consecutive_failures=1, retry_backoff_s=0.01)
    raised, sums = [], []
    while snap.step_count < 20:
        try:
            snap.step()
        except SnapshotWriteFailed:
            raised.append(snap.step_count)  # caught: the loop goes on, as the README allows
        # What DDP would do next step: a collective that needs every rank at the same step.
        step = torch.tensor([snap.step_count])
        dist.all_reduce(step)
        sums.append(int(step.item()))
    snap.close()
    Path(f"{tmp}/rank{rank}.json").write_text(json.dumps({"raised": raised, "sums": sums}))
    preempt.uninstall()
    dist.destroy_process_group()


@pytest.mark.parametrize("per_step_collective", [False, True])
def test_a_failed_save_is_raised_on_every_rank_at_the_same_step(
        tmp_path: Path, per_step_collective: bool) -> None:
    _join(tmp_path, _failing_rank, per_step_collective, timeout=120)  # a hang fails here
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["raised"] == r1["raised"] and len(r0["raised"]) >= 2
    if not per_step_collective:  # agreed when the ranks meet anyway: at the next save
        assert all(step % 3 == 0 for step in r0["raised"])
    assert r0["sums"] == r1["sums"] == [2 * s for s in range(1, 21)]  # in lockstep


def _no_ctx_rank(rank: int, tmp: str, port: int, via_init: bool) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2", ELASTICTRAIN_WATCHDOG__ENABLED="0",
                      ELASTICTRAIN_PREEMPT__ENABLED="0")
    if via_init:
        et.init(storage={"url": f"{tmp}/run"})
    else:
        dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)  # one replica on every rank, as DDP makes it
    snap = SnapshotManager(f"{tmp}/run", model=torch.nn.Linear(4, 4), every_steps=1)
    torch.manual_seed(100 + rank)  # each rank's RNG differs
    expected = capture_rng()
    snap.step()
    snap.close()
    torch.save(expected["torch"], f"{tmp}/rng{rank}.pt")
    Path(f"{tmp}/world{rank}").write_text(str(snap.ctx.world_size))
    if via_init:
        et.shutdown()
    else:
        dist.destroy_process_group()


@pytest.mark.parametrize("via_init", [True, False])
def test_a_manager_without_ctx_gathers_rng_from_every_rank(tmp_path: Path,
                                                           via_init: bool) -> None:
    _join(tmp_path, _no_ctx_rank, via_init, timeout=120)
    assert [(tmp_path / f"world{r}").read_text() for r in (0, 1)] == ["2", "2"]
    payload = verify_snapshot(open_store(str(tmp_path / "run")), 1, load=True).payload
    assert payload is not None
    assert payload["world_size"] == 2 and len(payload["rng"]) == 2
    for r in (0, 1):
        expected = torch.load(tmp_path / f"rng{r}.pt", weights_only=True)
        assert torch.equal(payload["rng"][r]["torch"], expected)
