"""The same DDP job (dropout included) trained with virtual shards at 1, 2, 3 and 4 ranks
ends on the same bits: each step's gradient is the shards' gradients summed in shard
order (worker/shard_sum.py), whichever ranks computed them. Plain DDP over the same
global batch does not (checked here too: the test can fail). Processes of
``torch.multiprocessing`` on gloo; a run resized under ``elastictrain run``:
tests/processes/multinode/test_resize_exact.py."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed

STEPS, SHARDS, GLOBAL = 6, 12, 48


def _job(rank: int, world: int, init: str, out: str, sharded: bool) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from elastictrain.worker.data import ElasticSampler
    from elastictrain.worker.shard_sum import ShardSum

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    data = torch.randn(400, 16)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.2),
                              torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = ElasticSampler(len(data), 4 if sharded else GLOBAL // world, rank, world,
                             global_batch_size=GLOBAL,
                             virtual_shards=SHARDS if sharded else None)
    shards = ShardSum(model)
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
    if rank == 0:
        digest = hashlib.sha256()
        for p in net.parameters():
            digest.update(p.detach().numpy().tobytes())
        Path(out).write_text(digest.hexdigest())
    dist.destroy_process_group()


def _digest(tmp_path: Path, world: int, sharded: bool) -> str:
    out = tmp_path / f"{world}-{sharded}.txt"
    init = f"file://{tmp_path}/group-{world}-{sharded}"
    # Forked: the workers start without importing torch again (CPU and gloo only).
    mp.start_processes(_job, args=(world, init, str(out), sharded), nprocs=world, join=True,
                       start_method="fork")
    return out.read_text()


@pytest.mark.timeout(300)
def test_virtual_shards_end_on_the_same_bits_at_every_world_size(tmp_path: Path) -> None:
    digests = {world: _digest(tmp_path, world, sharded=True) for world in (1, 2, 3, 4)}
    assert len(set(digests.values())) == 1, digests
    # Without them the same global batch at 3 and 4 ranks differs: dropout draws from each
    # rank's stream, and the sum is grouped by rank.
    plain = {world: _digest(tmp_path, world, sharded=False) for world in (3, 4)}
    assert plain[3] != plain[4]
