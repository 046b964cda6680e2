"""A user's training script of unknown length (no total step count anywhere): DDP on two
gloo workers, a snapshot every 10 steps, epochs until it is stopped.

Usage: ``elastictrain run --nproc-per-node 2 tests/processes/view/endless_job.py STORAGE``
"""

import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import elastictrain as et

rt = et.init()
torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
sampler = et.ElasticSampler(len(data), batch_size=16, rank=rt.rank, world_size=rt.world_size)
loader = DataLoader(data, batch_size=16, sampler=sampler, generator=torch.Generator())
snap = et.SnapshotManager(sys.argv[1], model=model, optimizer=opt, sampler=sampler,
                          ctx=rt.ctx, every_steps=10)
snap.restore()
print(f"rank {rt.rank}: training from step {snap.step_count}", flush=True)  # worker output
while True:
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.05)  # the step's compute: a real model's step takes this long, or more
        snap.step(loss=loss)
    snap.epoch += 1
