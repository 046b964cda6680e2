"""A small DDP job for tests/e2e/test_restore_unloadable.py (run by torchrun, not by
pytest): restore, train to STEPS with a snapshot every 5 steps, close.

    python -m torch.distributed.run ... tests/e2e/restore_job.py ROOT STEPS
"""

from __future__ import annotations

import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import elastictrain as et


def main() -> None:
    train(sys.argv[1], int(sys.argv[2]))


def train(root: str, steps: int) -> int:
    """Restore, train to ``steps``, close; returns this worker's rank."""
    rt = et.init()
    try:
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(8, 8))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        snap = et.SnapshotManager(root, model=model, optimizer=opt, ctx=rt.ctx, every_steps=5)
        snap.restore()
        while snap.step_count < steps:
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            snap.step()
        snap.close()
    finally:
        et.shutdown()
    return rt.ctx.rank


if __name__ == "__main__":
    main()
