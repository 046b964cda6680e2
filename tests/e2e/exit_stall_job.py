"""A DDP job whose rank 0 stalls in its exit on the first attempt (run by torchrun for
tests/e2e/test_exit_stall.py, not by pytest): restore_job's training (a snapshot
every 5 steps, to STEPS, close), then on attempt 0 rank 0 either stops itself
(SIGSTOP, as a chaos ``stop`` landing after the run finished) or keeps a core busy
for BUSY_S seconds (a long but live exit) while rank 1 exits 0.

    python -m torch.distributed.run ... tests/e2e/exit_stall_job.py ROOT STEPS stop|busy BUSY_S
"""

from __future__ import annotations

import os
import signal
import sys
import time

from tests.e2e.restore_job import train


def main() -> None:
    root, steps, mode, busy_s = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    rank = train(root, steps)
    if rank != 0 or os.environ.get("TORCHELASTIC_RESTART_COUNT") != "0":
        return
    if mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        until = time.monotonic() + busy_s
        while time.monotonic() < until:
            pass


if __name__ == "__main__":
    main()
