"""An epoch-based ``Trainer`` class on elastictrain.

The shape of many DDP scripts (PyTorch's DDP tutorial series among them): a Trainer
that trains epoch by epoch and, every few epochs, saves ``{"MODEL_STATE", "EPOCHS_RUN"}``
from rank 0 and reloads it at start. Converted here; each change is marked ``# et:``:

- the ``DistributedSampler`` becomes an ``ElasticSampler`` (the data position survives a
  kill mid-epoch and a change of world size);
- ``_load_snapshot``/``_save_snapshot`` become one ``SnapshotManager``: model, optimizer,
  sampler, epoch and every rank's RNG, saved every ``--save-every-steps`` steps (so a
  kill mid-epoch loses at most that many) and at every ``--save-every`` epochs;
- the loop starts at ``snap.epoch`` instead of ``EPOCHS_RUN``.

Run it::

    elastictrain run --nproc-per-node 2 examples/epoch_trainer.py ./ckpt --epochs 4
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 \\
        examples/epoch_trainer.py ./ckpt --epochs 4

``--record-samples DIR`` writes the ids each rank trained per step (the demo's format):
how the tests check that a resize trains every sample exactly once.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import elastictrain as et
from elastictrain.demo.records import SampleRecorder


class Regression(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """``size`` random samples of 20 features and one target, fixed by ``seed``; each
    item also carries its index (for ``--record-samples`` only)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 20, generator=generator)
        self.y = torch.randn(size, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


class Trainer:
    def __init__(self, rt: et.Runtime, model: torch.nn.Module, data: Regression,
                 optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> None:
        self.rt = rt
        self.model = DDP(model)
        self.optimizer = optimizer
        self.save_every = args.save_every
        # et: an ElasticSampler where the script had DistributedSampler(data).
        self.sampler = et.ElasticSampler(len(data), batch_size=args.batch_size,
                                         rank=rt.rank, world_size=rt.world_size)
        self.loader = DataLoader(data, batch_size=args.batch_size, sampler=self.sampler)
        # et: one manager in place of _load_snapshot/_save_snapshot.
        self.snap = et.SnapshotManager(args.storage, model=self.model, optimizer=optimizer,
                                       sampler=self.sampler, ctx=rt.ctx,
                                       every_steps=args.save_every_steps)
        self.snap.restore()  # et: was `if os.path.exists(path): self._load_snapshot(path)`
        self.recorder = (SampleRecorder.open(args.record_samples, rt)
                         if args.record_samples else None)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch: int) -> None:
        steps, loss = 0, float("nan")
        for source, targets, ids in self.loader:
            if self.recorder is not None:
                self.recorder.record(self.snap.step_count + 1, epoch, ids.tolist())
            loss = self._run_batch(source, targets)
            self.snap.step()  # et: a snapshot every --save-every-steps steps
            steps += 1
        if self.rt.rank == 0:
            print(f"epoch {epoch} | {steps} steps | loss {loss:.4f} | "
                  f"world size {self.rt.world_size}", flush=True)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.snap.epoch, max_epochs):  # et: was range(EPOCHS_RUN, …)
            self.snap.epoch = epoch
            self._run_epoch(epoch)
            if (epoch + 1) % self.save_every == 0:
                self.snap.epoch = epoch + 1  # et: the epoch is done: resume at the next
                self.snap.save()
        self.snap.close()  # et: waits for the last save; saves the last step if needed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("storage", help="where snapshots go: a path or a URL")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=1, help="epochs between saves")
    parser.add_argument("--save-every-steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--record-samples", metavar="DIR")
    args = parser.parse_args()

    rt = et.init()  # et: logging and the process group from the launcher's environment
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    Trainer(rt, model, Regression(args.samples), optimizer, args).train(args.epochs)
    et.shutdown()


if __name__ == "__main__":
    main()
