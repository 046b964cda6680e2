"""A run resized 4 → 3 → 2 → 4 ranks under ``elastictrain run`` ends on the same bits
as one that never resized, with virtual shards (``ElasticSampler(virtual_shards=12)``
and ``ShardSum``: docs/elastic-resume.md#the-same-bits-across-a-resize).

Agents on this machine, one c10d rendezvous: A (2 workers, the rendezvous host), B and C
(1 each) make 4 ranks; C's whole tree is SIGKILLed (3 ranks), then B's (2 ranks), then D
(2 workers) joins (4 ranks). tests/processes/multinode/resize_job.py trains an MLP with
dropout, a snapshot every step, and writes a ledger of what each rank trained. The
reference is one agent of 4 workers, never resized. Checked: the ranks the job ran at,
in order; in the ledger, every step's twelve shards trained once each (by the attempt
that trained the step last) and every sample once per epoch; the weights' digest equal
to the reference's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, child_env, events, free_port, kill_tree
from tests.processes.multinode.test_two_agents import port_open, wait_until

pytestmark = pytest.mark.distributed

JOB = Path(__file__).with_name("resize_job.py")
STEPS, EPOCH_STEPS, SHARDS, DATASET = 60, 25, 12, 600


class Agents:
    """Agents of one job (their own rendezvous and storage); every one is stopped."""

    def __init__(self, tmp_path: Path, name: str, nnodes: str, step_s: float) -> None:
        self.tmp_path, self.name, self.nnodes, self.step_s = tmp_path, name, nnodes, step_s
        self.root = tmp_path / name
        self.port = free_port()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, node: str, nproc: int) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "elastictrain.cli", "run", "--no-view",
                   "--nproc-per-node", str(nproc), "--nnodes", self.nnodes,
                   "--max-restarts", "6", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                   f"127.0.0.1:{self.port}", "--rdzv-id", f"{self.name}-{self.port}",
                   str(JOB), str(self.root), str(STEPS), "--step-s", str(self.step_s)]
        env = child_env(self.tmp_path, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        with open(self.tmp_path / f"{self.name}-{node}.log", "wb") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=self.tmp_path, env=env, start_new_session=True)
        self.procs[node] = proc
        if len(self.procs) == 1:  # the rendezvous host listens before the others join
            wait_until(lambda: port_open(self.port) or proc.poll() is not None, 120,
                       f"{self.name}'s rendezvous port")
        return proc

    def lose(self, node: str) -> None:
        """The node's whole tree SIGKILLed at once, as when a machine goes."""
        proc = self.procs.pop(node)
        kill_tree(proc.pid)
        proc.wait(timeout=30)

    def wait(self, timeout: float) -> dict[str, int]:
        try:
            return {node: proc.wait(timeout=timeout) for node, proc in self.procs.items()}
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name}: an agent did not end\n{self.tail()}") from None

    def tail(self) -> str:
        return "\n".join(log.read_text(errors="replace")[-2500:]
                         for log in sorted(self.tmp_path.glob(f"{self.name}-*.log")))

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                kill_tree(proc.pid)
            proc.wait(timeout=30)

    def ledger(self) -> list[dict[str, Any]]:
        lines = (json.loads(line) for file in sorted((self.root / "ledger").glob("*.jsonl"))
                 for line in file.read_text().splitlines() if line.strip())
        return sorted(lines, key=lambda r: r["t"])

    def digests(self) -> set[str]:
        """The final weights' digests logged at the end (one: the run ended once)."""
        return {str(e["param_digest"]) for e in events(self.root / "events", "params.digest")
                if e.get("role") != "agent"}


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[list[Agents]]:
    made: list[Agents] = []
    try:
        yield made
    finally:
        for job in made:
            job.stop()


def _trained(job: Agents, world: int, steps: int, since: float = 0.0) -> bool:
    """Whether an attempt at ``world`` ranks, begun after ``since``, trained ``steps``."""
    done: dict[str, set[int]] = defaultdict(set)
    for record in job.ledger():
        if record["world"] == world and record["t"] > since:
            done[record["attempt"]].add(record["step"])
    return any(len(steps_of) >= steps for steps_of in done.values())


@pytest.mark.timeout(600)
def test_a_run_resized_4_3_2_4_ends_on_the_bits_of_one_never_resized(
        tmp_path: Path, jobs: list[Agents]) -> None:
    reference = Agents(tmp_path, "reference", "1:1", step_s=0.0)
    jobs.append(reference)
    reference.start("solo", 4)
    # Paced (a workload of 0.5 s a step) so that each size trains a few steps before
    # the next change: a join restarts the group only after the training has gone on.
    job = Agents(tmp_path, "resized", "1:4", step_s=0.5)
    jobs.append(job)
    job.start("a", 2)
    job.start("b", 1)
    job.start("c", 1)
    wait_until(lambda: _trained(job, 4, 3), 240, f"4 ranks training\n{job.tail()}")
    job.lose("c")
    wait_until(lambda: _trained(job, 3, 3), 240, f"3 ranks training\n{job.tail()}")
    job.lose("b")
    lost = time.time()
    wait_until(lambda: _trained(job, 2, 3, since=lost), 240, f"2 ranks training\n{job.tail()}")
    joined = time.time()
    job.start("d", 2)
    wait_until(lambda: _trained(job, 4, 1, since=joined), 240, f"4 ranks again\n{job.tail()}")
    (job.root / "unpaced").write_text("")  # no change is left to make: the rest at full speed
    assert job.wait(timeout=300) == {"a": 0, "d": 0}, job.tail()
    assert reference.wait(timeout=300) == {"solo": 0}, reference.tail()

    ledger = job.ledger()
    worlds = [r["world"] for r in ledger]
    changes = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
    assert changes[-4:] == [4, 3, 2, 4], changes  # the start may form at 2 or 3 first
    # The attempt that trained a step last is the one the run kept.
    by_step: dict[int, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for record in ledger:
        by_step[record["step"]][record["attempt"]].append(record)
    assert sorted(by_step) == list(range(1, STEPS + 1))
    epochs: dict[int, list[int]] = defaultdict(list)
    for step, attempts in sorted(by_step.items()):
        kept = max(attempts.values(), key=lambda records: records[-1]["t"])
        assert sorted(r["shard"] for r in kept) == list(range(SHARDS)), step
        epochs[(step - 1) // EPOCH_STEPS] += [i for r in kept for i in r["ids"]]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(DATASET))  # once an epoch
    assert len(epochs[2]) == len(set(epochs[2])) == (STEPS - 2 * EPOCH_STEPS) * 24
    assert len(job.digests()) == 1 and job.digests() == reference.digests()
