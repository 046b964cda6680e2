"""A DDP job with virtual shards, for tests/processes/multinode/test_resize_exact.py.

    resize_job.py ROOT STEPS [--step-s S]    (S: until the file ROOT/unpaced exists)

A fixed global batch of 24 cut into 12 virtual shards (``ElasticSampler``), read by a
``DataLoader`` with ``MicroBatchSampler``, gradients summed by ``ShardSum``; an MLP with
dropout and AdamW; a snapshot every step. Every rank appends what it trained to
``ROOT/ledger/<pid>.jsonl`` (the attempt, rank 0's token for it; step, shard, sample
ids, world size, time); ``close()`` logs the final weights' digest (``params.digest``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import elastictrain as et

GLOBAL, SHARDS, MICRO = 24, 12, 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("steps", type=int)
    parser.add_argument("--step-s", type=float, default=0.0)
    args = parser.parse_args()
    rt = et.init()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(600, 10), torch.arange(600))
    net = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Dropout(0.1), torch.nn.Tanh(),
                              torch.nn.Linear(32, 1))
    model = DistributedDataParallel(net) if rt.ctx.initialized else net
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = et.ElasticSampler(len(data), MICRO, rt.rank, rt.world_size, seed=1,
                                global_batch_size=GLOBAL, virtual_shards=SHARDS)
    shards = et.ShardSum(model)
    snap = et.SnapshotManager(args.root, model=model, optimizer=opt, sampler=sampler,
                              ctx=rt.ctx, every_steps=1)
    snap.restore()
    ledger = Path(args.root) / "ledger"
    ledger.mkdir(parents=True, exist_ok=True)
    attempt = rt.ctx.broadcast_object(uuid.uuid4().hex)  # the agents count restarts apart
    record = (ledger / f"{os.getpid()}.jsonl").open("a")
    while snap.step_count < args.steps:
        loader = DataLoader(data, batch_sampler=et.MicroBatchSampler(sampler))
        for step in et.optimizer_steps(loader):
            opt.zero_grad(set_to_none=True)
            for micro, (x, ids) in step:
                with shards.shard(micro):
                    loss = model(x).pow(2).mean() * micro.loss_scale
                    loss.backward()
                record.write(json.dumps({
                    "attempt": attempt, "step": snap.step_count + 1, "shard": micro.shard,
                    "ids": ids.tolist(), "world": rt.world_size, "t": time.time()}) + "\n")
            record.flush()
            shards.reduce()
            opt.step()
            if not (Path(args.root) / "unpaced").exists():  # the test's last change made
                time.sleep(args.step_s)  # the job's compute time per step (a workload)
            snap.step()
            if snap.step_count >= args.steps:
                break
        else:
            sampler.set_epoch(sampler.epoch + 1)
    snap.close()  # logs params.digest, the final weights' digest
    et.shutdown()


if __name__ == "__main__":
    main()
