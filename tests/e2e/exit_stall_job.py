"""A DDP job whose rank 0 stalls in its exit on the first attempt (run by torchrun for
tests/e2e/test_exit_stall.py, not by pytest): train to STEPS with a snapshot every 5
steps, close, then on attempt 0 rank 0 either stops itself (SIGSTOP, as a chaos
``stop`` landing after the run finished) or keeps a core busy for BUSY_S seconds
(a long but live exit) while rank 1 exits 0.

    python -m torch.distributed.run ... tests/e2e/exit_stall_job.py ROOT STEPS stop|busy BUSY_S
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import elastictrain as et


def main() -> None:
    root, steps, mode, busy_s = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
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
    if rt.ctx.rank != 0 or os.environ.get("TORCHELASTIC_RESTART_COUNT") != "0":
        return
    if mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        until = time.monotonic() + busy_s
        while time.monotonic() < until:
            pass


if __name__ == "__main__":
    main()
