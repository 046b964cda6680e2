"""A one-process job for tests/memtier/test_node_*.py (run as a real process, no
launcher: its run id is ``local`` unless ``ELASTICTRAIN_RUN_ID`` says otherwise).

    python tests/memtier/node_job.py ROOT STEPS PARK

Restores from ROOT (memory tier every step, durable every 100 steps), prints one JSON
line ``{"tier", "from_step", "memory_dir"}``, trains to STEPS and closes. After step
PARK (0: never) it waits for the memory snapshot of that step, prints
``{"parked": PARK}`` and reads a line from stdin before it goes on: the test acts
meanwhile, synchronised by the pipe.
"""

from __future__ import annotations

import json
import sys

import torch

import elastictrain as et


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    root, steps, park = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rt = et.init()
    torch.manual_seed(len(root))  # another storage, another model
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = et.SnapshotManager(root, model=model, optimizer=opt, ctx=rt.ctx, every_steps=100,
                              memory_every=1)
    info = snap.restore()
    tier = snap._node_memory.tier
    say(tier=info.tier, from_step=info.from_step,
        memory_dir=None if tier is None else str(tier.path))
    while snap.step_count < steps:
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        snap.step()
        if snap.step_count == park:
            snap.wait()
            say(parked=park)
            sys.stdin.readline()
    snap.close()
    say(done=snap.step_count)


if __name__ == "__main__":
    main()
