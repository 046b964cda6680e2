"""Sample accounting over the demo's ``--record-samples`` files, and cleanup of
what a multi-agent demo may leave behind when a test fails.

Independent of the sampler's own code on purpose: it checks what the workers
report they trained, not what the sampler meant to deal.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastictrain.worker.data import ElasticSampler
from tests.helpers import events


@dataclass
class StepRun:
    """One surviving execution of an optimizer step: all ranks of one world."""

    step: int
    epoch: int
    world: str
    world_size: int
    samples: list[int]


def surviving_steps(record_dir: Path) -> dict[int, StepRun]:
    """For each step, the execution of the latest world that ran it (a step redone
    after a restart replaces the earlier one). Asserts that execution is complete:
    every rank of that world recorded the step once, all in the same epoch."""
    records = events(record_dir)
    started: dict[str, float] = {}
    by_step: dict[int, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        started[r["world"]] = min(started.get(r["world"], r["ts"]), r["ts"])
        by_step[r["step"]][r["world"]].append(r)
    steps: dict[int, StepRun] = {}
    for step, worlds in by_step.items():
        world = max(worlds, key=lambda w: started[w])
        rows = worlds[world]
        size = rows[0]["world_size"]
        assert sorted(r["rank"] for r in rows) == list(range(size)), (step, rows)
        assert len({r["epoch"] for r in rows}) == 1, (step, rows)
        steps[step] = StepRun(step, rows[0]["epoch"], world, size,
                              [i for r in sorted(rows, key=lambda r: r["rank"])
                               for i in r["samples"]])
    return steps


def assert_each_sample_once(steps: dict[int, StepRun], dataset_len: int, seed: int,
                            final_step: int) -> dict[int, int]:
    """Steps 1..final_step all survive; every finished epoch trained each sample
    exactly once plus the documented tail padding (the epoch's first ``pad``
    samples, ``pad`` < the world size of its last step); the unfinished last epoch
    trained no sample twice. Returns {epoch: pad} of the finished epochs."""
    assert sorted(steps) == list(range(1, final_step + 1)), sorted(steps)
    epochs: dict[int, list[StepRun]] = defaultdict(list)
    for run in steps.values():
        epochs[run.epoch].append(run)
    assert sorted(epochs) == list(range(len(epochs))), sorted(epochs)
    pads: dict[int, int] = {}
    for epoch, runs in sorted(epochs.items()):
        runs.sort(key=lambda r: r.step)
        trained = Counter(i for r in runs for i in r.samples)
        if epoch == max(epochs):
            assert max(trained.values()) == 1, trained.most_common(3)
            continue
        pad = sum(trained.values()) - dataset_len
        order = ElasticSampler(dataset_len, 1, seed=seed).epoch_order(epoch)
        extra = Counter(order[i % dataset_len] for i in range(max(pad, 0)))
        assert trained == Counter(range(dataset_len)) + extra, (epoch, pad)
        assert 0 <= pad < runs[-1].world_size
        pads[epoch] = pad
    return pads


def kill_leftovers(events_root: Path) -> None:
    """SIGKILL demo agents (``agent.pid`` files) and workers (``worker.start`` events)
    that still run, by PID, after checking the PID still belongs to them."""
    for pid_file in events_root.rglob("agent.pid"):
        pid = int(pid_file.read_text())
        if _runs(pid, "elastictrain.launcher.launch"):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    for event in events(events_root, "worker.start"):
        pid = int(event["pid"])
        if _runs(pid, "elastictrain.demo.worker"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _runs(pid: int, needle: str) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
