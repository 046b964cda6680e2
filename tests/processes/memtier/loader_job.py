"""A two-rank job whose per-rank data position lives in a torchdata ``StatefulDataLoader``
(``state=``), for tests/processes/memtier/test_stateful_loader_e2e.py: each rank trains
its own shard, shuffled, through two loader workers; rank 1 of the first attempt may
SIGKILL itself in the middle of a step. The snapshot policy comes from
``ELASTICTRAIN_SNAPSHOT__*``.

    python tests/processes/memtier/loader_job.py ROOT EPOCHS [DIE_IN_STEP]
"""

from __future__ import annotations

import os
import signal
import sys

from torch.nn.parallel import DistributedDataParallel

import elastictrain as et
from tests.stateful_loader_job import loader, model_and_optimizer, train

SAMPLES = 40  # per rank: 10 steps an epoch


def main() -> None:
    root, epochs = sys.argv[1], int(sys.argv[2])
    die_in = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    rt = et.init()
    first_attempt = rt.env.restart_count == 0
    model, opt = model_and_optimizer()
    ddp = DistributedDataParallel(model)
    data = loader(SAMPLES, rt.rank)
    snap = et.SnapshotManager(root, model=ddp, optimizer=opt, state={"loader": data})
    snap.restore()

    def in_step(step: int) -> None:
        if first_attempt and rt.rank == 1 and step == die_in:
            os.kill(os.getpid(), signal.SIGKILL)

    train(ddp, opt, data, snap, epochs, in_step=in_step)
    snap.close()
    et.shutdown()


if __name__ == "__main__":
    main()
