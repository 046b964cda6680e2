"""A small DDP job for tests/memtier (run by torchrun, not by pytest): restore, train to
STEPS with a durable snapshot every EVERY steps and a memory snapshot every MEMORY_EVERY
steps (default 1), close.

    python -m elastictrain.launch ... tests/memtier/memtier_job.py ROOT STEPS EVERY PARK GATES \
        [MEMORY_EVERY [DIE_IN [FROZEN_MB [LATE_SURVIVOR]]]]

Each step's batch is a function of the step and rank only, so a resumed run is
bit-exact. In the first attempt every rank stops after step PARK (PARK 0: never),
writes ``GATES/rank<r>.json`` with its PID and waits for ``GATES/go``: the test
kills what it must meanwhile. With DIE_IN > 0, rank 1 of the first attempt SIGKILLs
itself in the middle of step DIE_IN, between its forward and its backward (no boundary,
no barrier). Every step also draws from the global python, torch and numpy RNGs, so
a resume with any rank's RNG state wrong is not bit-exact. FROZEN_MB adds a frozen
parameter of that size (no compute, but every snapshot holds it). With LATE_SURVIVOR 1,
rank 0 meets rank 1's death only after the agent saw it: it starts its backward once
``agent.failure_detected`` is in the run's event log. The memory directory comes
from ``ELASTICTRAIN_SNAPSHOT__MEMORY_DIR`` (one per node).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import elastictrain as et
from elastictrain.launch import EVENTS_DIR_VAR

PARK_TIMEOUT_S = 300.0


def park(gates: Path, rank: int) -> None:
    """Tell the test where we are, then wait for it (a condition with a deadline)."""
    gates.mkdir(parents=True, exist_ok=True)
    (gates / f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), "rank": rank}))
    deadline = time.monotonic() + PARK_TIMEOUT_S
    while not (gates / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def await_event(events_dir: Path, name: str) -> None:
    """Wait until an event ``name`` is in a file under ``events_dir`` (with a deadline)."""
    deadline = time.monotonic() + PARK_TIMEOUT_S
    while time.monotonic() < deadline:
        for file in events_dir.rglob("*.jsonl"):
            for line in file.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    if json.loads(line).get("event") == name:
                        return
        time.sleep(0.02)


def main() -> None:
    root, steps, every, park_at, gates = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                          int(sys.argv[4]), Path(sys.argv[5]))
    memory_every, die_in, frozen_mb, late_survivor = (
        int(sys.argv[i]) if len(sys.argv) > i else default
        for i, default in ((6, 1), (7, 0), (8, 0), (9, 0)))
    rt = et.init()
    try:
        torch.manual_seed(0)
        random.seed(rt.ctx.rank)  # a stream of its own per rank (restored, not re-seeded)
        np.random.seed(rt.ctx.rank)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                  torch.nn.Linear(64, 8))
        if frozen_mb:
            net.frozen = torch.nn.Parameter(torch.ones(frozen_mb * 2**18), requires_grad=False)
        model = DDP(net)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        snap = et.SnapshotManager(root, model=model, optimizer=opt, ctx=rt.ctx,
                                  every_steps=every, memory_every=memory_every)
        snap.restore()
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        while snap.step_count < steps:
            data = torch.Generator().manual_seed(1000 * snap.step_count + rt.ctx.rank)
            noise = torch.rand(16, 32) * random.random() * float(np.random.rand())
            loss = model(torch.randn(16, 32, generator=data) + noise).pow(2).mean()
            if first_attempt and rt.ctx.rank == 1 and snap.step_count + 1 == die_in:
                os.kill(os.getpid(), signal.SIGKILL)
            if first_attempt and late_survivor and snap.step_count + 1 == die_in:
                await_event(Path(os.environ[EVENTS_DIR_VAR]), "agent.failure_detected")
            loss.backward()
            opt.step()
            opt.zero_grad()
            snap.step()
            if (first_attempt and snap.step_count == park_at
                    and not (gates / "go").exists()):
                # A copy behind commits once the training thread judged it (at the next
                # step's fence, or here): a parked rank takes no next step.
                snap.wait()
                park(gates, rt.ctx.rank)
        snap.close()
    finally:
        et.shutdown()


if __name__ == "__main__":
    main()
