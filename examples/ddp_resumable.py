import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import elastictrain as et

rt = et.init()  # logging + process group from torchrun's environment
torch.manual_seed(0)
data = TensorDataset(torch.randn(512, 8), torch.randn(512, 1))
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
sampler = et.ElasticSampler(len(data), batch_size=16, rank=rt.rank, world_size=rt.world_size)
loader = DataLoader(data, batch_size=16, sampler=sampler, generator=torch.Generator())
snap = et.SnapshotManager(sys.argv[1], model=model, optimizer=opt, sampler=sampler,
                          ctx=rt.ctx, every_steps=10)
snap.restore()  # newest verified snapshot, or a fresh start
while snap.epoch < 3:
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        snap.step(loss=loss)  # saves every 10 steps on every rank; checks the loss after a restore
    snap.epoch += 1
snap.close()
et.shutdown()
