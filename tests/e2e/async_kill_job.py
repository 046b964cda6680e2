"""A small DDP job for tests/e2e/test_async_kill.py (run by torchrun, not by pytest).

On the first attempt rank 0's storage stalls the payload write of step 20
mid-file, forever: the test SIGKILLs rank 0 while that persist is in flight.
Later attempts write normally.

    python -m torch.distributed.run ... tests/e2e/async_kill_job.py ROOT JOURNAL GATE
"""

from __future__ import annotations

import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import elastictrain as et
from elastictrain.storage import Store, open_store
from tests.fault_stores import GatedStore


def main() -> None:
    root, journal, gate = sys.argv[1:4]
    rt = et.init()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(32, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    store: Store = open_store(root)
    if rt.env.restart_count == 0:
        store = GatedStore(store, journal, gate, stall_steps={20})  # type: ignore[assignment]
    snap = et.SnapshotManager(store, model=model, optimizer=opt, ctx=rt.ctx, every_steps=10,
                              persister="process")
    snap.restore()
    while snap.step_count < 30:
        loss = model(torch.randn(8, 32)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        snap.step()
    snap.close()
    et.shutdown()


if __name__ == "__main__":
    main()
