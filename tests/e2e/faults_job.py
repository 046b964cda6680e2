"""A small DDP training job for tests/e2e/test_faults_*.py.

``python faults_job.py STORAGE STEPS``: trains until STEPS, takes a final snapshot and
exits. The test switches storage faults on through the environment, never by
editing the script: ``FAULTS_JOB_FAIL_WHILE=PATH`` (payload writes fail while PATH
exists), ``FAULTS_JOB_TRICKLE=CHUNK_BYTES:DELAY_S`` (a slow upload that keeps
moving). ``FAULTS_JOB_STEP_S`` is the compute time of one step. Everything else
(snapshot policy, watchdog, events) comes from ``ELASTICTRAIN_*``: the manager is
built without ``ctx`` or ``config``, as a user script would.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel

import elastictrain as et
from elastictrain.storage import Store, open_store
from tests.fault_stores import SwitchedStore, TricklingStore


def faulty_store(url: str) -> Store:
    store: Store = open_store(url)
    if os.environ.get("FAULTS_JOB_FAIL_WHILE"):
        store = SwitchedStore(store, os.environ["FAULTS_JOB_FAIL_WHILE"])  # type: ignore[assignment]
    if os.environ.get("FAULTS_JOB_TRICKLE"):
        chunk, delay = os.environ["FAULTS_JOB_TRICKLE"].split(":")
        store = TricklingStore(store, int(chunk), float(delay))  # type: ignore[assignment]
    return store


def main() -> None:
    url, steps = sys.argv[1], int(sys.argv[2])
    step_s = float(os.environ.get("FAULTS_JOB_STEP_S", "0"))
    rt = et.init()
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(1024, 1024)
        ddp = DistributedDataParallel(model) if rt.ctx.initialized else model
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        snap = et.SnapshotManager(faulty_store(url), model=ddp, optimizer=opt)
        snap.restore()
        while snap.step_count < steps:
            loss = ddp(torch.randn(4, 1024)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(step_s)  # the job's compute time per step (a workload, not a wait)
            snap.step()
        snap.save()
        snap.close()  # logs run.finished (final_step) on rank 0
    finally:
        et.shutdown()


if __name__ == "__main__":
    main()
