"""The same DDP job (dropout included) trained with virtual shards at 1, 2, 3 and 4 ranks
ends on the same bits: each step's gradient is the shards' gradients summed in shard
order (worker/shard_sum.py), whichever ranks computed them. Plain DDP over the same
global batch does not (checked here too: the test can fail).

Four processes of ``torch.multiprocessing`` (spawned: the test's own process may run
threads that a fork would copy half-way) in one gloo group; each world size is a
subgroup of the first W ranks, trained in turn. A run resized under ``elastictrain run``:
tests/processes/multinode/test_resize_exact.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed

STEPS, SHARDS, GLOBAL, RANKS = 6, 12, 48, 4


def _train(rank: int, world: int, group: dist.ProcessGroup, sharded: bool) -> str:
    """Rank ``rank`` of a ``world``-rank job on ``group``: the weights' digest."""
    from torch.nn.parallel import DistributedDataParallel

    from elastictrain.worker.data import ElasticSampler
    from elastictrain.worker.shard_sum import ShardSum

    torch.manual_seed(0)
    data = torch.randn(400, 16)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.2),
                              torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model = DistributedDataParallel(net, process_group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = ElasticSampler(len(data), 4 if sharded else GLOBAL // world, rank, world,
                             global_batch_size=GLOBAL,
                             virtual_shards=SHARDS if sharded else None)
    shards = ShardSum(model, group=group)
    steps = sampler.steps()
    for _ in range(STEPS):
        plan = next(steps)
        opt.zero_grad(set_to_none=True)
        for micro in plan.micros:
            x = data[list(micro.indices)]
            if sharded:
                with shards.shard(micro):
                    (model(x).pow(2).mean() * micro.loss_scale).backward()
            else:
                (model(x).pow(2).mean() * micro.loss_scale).backward()
        if sharded:
            shards.reduce()
        opt.step()
    digest = hashlib.sha256()
    for p in net.parameters():
        digest.update(p.detach().numpy().tobytes())
    return digest.hexdigest()


def _job(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=RANKS)
    digests = {}
    for sharded, worlds in ((True, (1, 2, 3, 4)), (False, (3, 4))):
        for world in worlds:
            group = dist.new_group(list(range(world)))  # every rank takes part in making it
            if rank < world:
                digests[f"{'shards' if sharded else 'plain'}-{world}"] = _train(
                    rank, world, group, sharded)
            dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(digests))
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_virtual_shards_end_on_the_same_bits_at_every_world_size(tmp_path: Path) -> None:
    out = tmp_path / "digests.json"
    workers = mp.spawn(_job, args=(f"file://{tmp_path}/group", str(out)), nprocs=RANKS,
                       join=False)
    try:
        while not workers.join(timeout=5):  # raises when one fails (the others stopped)
            pass
    finally:  # also when the test's own time runs out: no worker outlives it
        for worker in workers.processes:
            if worker.is_alive():
                worker.kill()
            worker.join()
    digests = json.loads(out.read_text())
    sharded = {digests[f"shards-{world}"] for world in (1, 2, 3, 4)}
    assert len(sharded) == 1, digests
    # Without them the same global batch at 3 and 4 ranks differs: dropout draws from each
    # rank's stream, and the sum is grouped by rank.
    assert digests["plain-3"] != digests["plain-4"]
