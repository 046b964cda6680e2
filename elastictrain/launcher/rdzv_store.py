"""``elastictrain rendezvous-store``: the c10d rendezvous store in a process of its own.

With ``--rdzv-backend c10d`` the store lives in the agent of the node whose address
``--rdzv-endpoint`` names, and losing that node ends the job. Run this on a host that
is not reclaimed (a login node, an on-demand instance) and point every node's
``--rdzv-endpoint`` at it: an agent finds the port taken and joins as a client (torch's
c10d backend does that by itself), so any training node, the first one included, can be
lost. docs/guide.md#a-rendezvous-no-node-holds.
"""

from __future__ import annotations

import signal

import structlog
from torch.distributed import TCPStore

log = structlog.get_logger("elastictrain.launcher")


def serve(host: str, port: int) -> int:
    """Serve the store on ``host:port`` until SIGTERM or SIGINT; exit code 0."""
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # taken by sigwait below, not raised
    store = TCPStore(host, port, is_master=True, wait_for_workers=False)
    log.info("rendezvous_store.serving", host=host, port=store.port)
    received = signal.sigwait(stop)
    log.info("rendezvous_store.stopped", signal=signal.Signals(received).name)
    del store
    return 0
