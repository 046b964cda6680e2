"""The rendezvous store of a chaos node trial, in a process of its own.

    python -m elastictrain.chaos.rdzvstore PORT_FILE

With torchrun's c10d backend the store lives in the first agent by default, so losing
that node ends the job for every other node. A cluster that must survive the loss of
any node runs the rendezvous apart (an etcd, or a store on a machine that stays), and
so does a node trial: every agent connects as a client (``is_host=0``), and any node
may be the one lost. Listens on 127.0.0.1, on a port the kernel picks, written to
PORT_FILE once it listens; runs until it is killed.
"""

from __future__ import annotations

import os
import sys
import threading
from datetime import timedelta
from pathlib import Path

from torch.distributed import TCPStore


def main() -> int:
    port_file = Path(sys.argv[1])
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=60))
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(str(store.port))
    os.replace(tmp, port_file)  # whole or absent: the harness polls for it
    threading.Event().wait()  # serve until the harness kills this process
    return 0


if __name__ == "__main__":
    sys.exit(main())
