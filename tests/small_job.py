"""Small training jobs in the test's own process, for the snapshot tests: ``build`` and
``train`` carry every kind of state (model, optimizer, scheduler, scaler, sampler, RNG);
``build_plain`` and ``train_plain`` only a model and its optimizer, on random batches."""

from __future__ import annotations

import random
from typing import Any

import torch

import elastictrain as et
from elastictrain.snapshot.manager import SnapshotManager

# The persisters of an asynchronous save.
ASYNC = ["thread", "process"]


def build(url: str, **kw: Any) -> tuple[torch.nn.Module, Any, Any, et.ElasticSampler,
                                        et.SnapshotManager]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Dropout(0.3),
                                torch.nn.Linear(6, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    sampler = et.ElasticSampler(40, 4, seed=1)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    snap = et.SnapshotManager(url, model=model, optimizer=opt, scheduler=sched, scaler=scaler,
                              sampler=sampler, **{"every_steps": 5, "keep": 2, **kw})
    return model, opt, sched, sampler, snap


def train(model: torch.nn.Module, opt: Any, sched: Any, sampler: et.ElasticSampler,
          snap: et.SnapshotManager, until: int) -> list[float]:
    data = torch.randn(40, 6, generator=torch.Generator().manual_seed(5))
    losses = []
    while snap.step_count < until:
        batch = data[list(sampler)[:4]]
        loss = model(batch).pow(2).mean() + random.random() * 0  # python RNG advances too
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        snap.step()
        losses.append(loss.item())
        if sampler.epoch_done:
            snap.epoch += 1
    return losses


def build_plain(storage: Any, persister: str = "thread", seed: int = 0,
         **kw: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, SnapshotManager]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.2),
                                torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mode = "sync" if persister == "sync" else "async"
    persister = "thread" if persister == "sync" else persister
    snap = SnapshotManager(storage, model=model, optimizer=opt, mode=mode, persister=persister,
                           **kw)
    return model, opt, snap


def train_plain(model: torch.nn.Module, opt: torch.optim.Optimizer, snap: SnapshotManager,
          until: int) -> list[float]:
    losses = []
    while snap.step_count < until:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        snap.step()
        losses.append(loss.item())
    return losses


def one_rank_fsdp2(inputs: int, hidden: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An FSDP2 model of two linear layers (each sharded, then the whole) on a process
    group of this process alone (the ``one_rank_group`` fixture), and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.Tanh(),
                                torch.nn.Linear(hidden, 1))
    mesh = init_device_mesh("cpu", (1,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)
