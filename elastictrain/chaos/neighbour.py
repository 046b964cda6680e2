"""The ``shm_neighbour`` fault's second run: another job on the node, with its own
storage, the run id every launcher-less job has (``local``) and the default memory
directory root, training with a memory snapshot every step.

    python -m elastictrain.chaos.neighbour ROOT STEPS

Exits 0 when it finished from a fresh start (it must never load the trial's memory
snapshot), 3 when it restored something, 1 on an error.
"""

from __future__ import annotations

import sys

import torch

import elastictrain as et


def main() -> int:
    root, steps = sys.argv[1], int(sys.argv[2])
    rt = et.init()
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    snap = et.SnapshotManager(root, model=model, optimizer=opt, ctx=rt.ctx, every_steps=1000,
                              memory_every=1)
    info = snap.restore()
    while snap.step_count < steps:
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        snap.step()
    snap.close()
    return 0 if info.from_step is None else 3


if __name__ == "__main__":
    sys.exit(main())
