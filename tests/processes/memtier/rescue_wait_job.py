"""A one-process job for tests/processes/memtier/test_node_rescue_marks.py: two steps with a
memory tier, then a memory save that is still in flight (it waits for the test, on
stdin) when an uncaught error starts the rescue.

    python tests/processes/memtier/rescue_wait_job.py ROOT MEMORY_DIR
"""

from __future__ import annotations

import sys

import torch

import elastictrain as et
from elastictrain.snapshot.memory import rescue


def main() -> None:
    rt = et.init()
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = et.SnapshotManager(sys.argv[1], model=model, optimizer=opt, ctx=rt.ctx,
                              every_steps=100, memory_every=100, memory_dir=sys.argv[2])
    snap.restore()
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        snap.step()
    memory_saver = snap._memory
    assert memory_saver is not None

    def in_flight(step: int) -> None:  # a memory save the rescue must wait for
        print("waiting", flush=True)
        sys.stdin.readline()

    memory_saver.wait_in_flight = in_flight  # type: ignore[method-assign]
    rescue.on_uncaught(RuntimeError("a peer died"))
    print("done", flush=True)


if __name__ == "__main__":
    main()
