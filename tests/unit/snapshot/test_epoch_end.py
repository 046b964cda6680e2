"""A snapshot taken at an epoch's last step resumes at the next epoch's start: the
loader hands the loop the next epoch's batches, never an empty epoch, and the resumed
run ends on the uninterrupted run's weights."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import elastictrain as et
from elastictrain.snapshot.format.digest import param_digest

SAMPLES, BATCH = 24, 4
STEPS_PER_EPOCH = SAMPLES // BATCH


Job = tuple[torch.nn.Module, torch.optim.Optimizer, DataLoader[tuple[torch.Tensor, ...]],
            et.SnapshotManager]


def _job(url: str) -> Job:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(SAMPLES, 3, generator=torch.Generator().manual_seed(1)))
    sampler = et.ElasticSampler(SAMPLES, BATCH, seed=2)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    snap = et.SnapshotManager(url, model=model, optimizer=opt, sampler=sampler,
                              every_steps=STEPS_PER_EPOCH, save_on_close=False)
    return model, opt, loader, snap


def _epochs(model: torch.nn.Module, opt: torch.optim.Optimizer,
            loader: DataLoader[tuple[torch.Tensor, ...]], snap: et.SnapshotManager,
            until_epoch: int) -> list[int]:
    """The tutorial's loop shape: one batch looked at before each epoch, then the epoch;
    returns the number of batches each epoch trained."""
    trained = []
    for epoch in range(snap.epoch, until_epoch):
        snap.epoch = epoch
        (first,) = next(iter(loader))  # raises StopIteration on an empty epoch
        assert first.shape[0] == BATCH
        batches = 0
        for (x,) in loader:
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            snap.step()
            batches += 1
        trained.append(batches)
    return trained


def test_a_snapshot_at_the_epochs_last_step_resumes_into_the_next_epoch(tmp_path: Path
                                                                       ) -> None:
    reference = _job(str(tmp_path / "ref"))
    assert _epochs(*reference, until_epoch=3) == [STEPS_PER_EPOCH] * 3
    reference[3].close()

    first = _job(str(tmp_path / "run"))
    assert _epochs(*first, until_epoch=1) == [STEPS_PER_EPOCH]  # saved at its last step
    first[3].close()  # as if killed here: no save on close

    resumed = _job(str(tmp_path / "run"))
    assert resumed[3].restore().from_step == STEPS_PER_EPOCH
    assert resumed[3].epoch == 1
    assert _epochs(*resumed, until_epoch=3) == [STEPS_PER_EPOCH] * 2
    assert param_digest(resumed[0]) == param_digest(reference[0])
    resumed[3].close()
