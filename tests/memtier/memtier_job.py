"""A small DDP job for tests/memtier (run by torchrun, not by pytest): restore, train to
STEPS with a durable snapshot every EVERY steps and a memory snapshot every step, close.

    python -m elastictrain.launch ... tests/memtier/memtier_job.py ROOT STEPS EVERY PARK GATES

Each step's batch is a function of the step and rank only, so a resumed run is
bit-exact. In the first attempt every rank stops after step PARK (PARK 0: never),
writes ``GATES/rank<r>.json`` with its PID and waits for ``GATES/go``: the test
kills what it must meanwhile. The memory directory comes from
``ELASTICTRAIN_SNAPSHOT__MEMORY_DIR`` (one per node).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import elastictrain as et

PARK_TIMEOUT_S = 300.0


def park(gates: Path, rank: int) -> None:
    """Tell the test where we are, then wait for it (a condition with a deadline)."""
    gates.mkdir(parents=True, exist_ok=True)
    (gates / f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), "rank": rank}))
    deadline = time.monotonic() + PARK_TIMEOUT_S
    while not (gates / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    root, steps, every, park_at, gates = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                          int(sys.argv[4]), Path(sys.argv[5]))
    rt = et.init()
    try:
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                        torch.nn.Linear(64, 8)))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        snap = et.SnapshotManager(root, model=model, optimizer=opt, ctx=rt.ctx,
                                  every_steps=every, memory_every=1)
        snap.restore()
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        while snap.step_count < steps:
            data = torch.Generator().manual_seed(1000 * snap.step_count + rt.ctx.rank)
            model(torch.randn(16, 32, generator=data)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            snap.step()
            if (first_attempt and snap.step_count == park_at
                    and not (gates / "go").exists()):
                park(gates, rt.ctx.rank)
        snap.close()
    finally:
        et.shutdown()


if __name__ == "__main__":
    main()
