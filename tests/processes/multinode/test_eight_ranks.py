"""Eight ranks under two agents: a worker killed, a preemption, a resume to a clean end.

Two ``elastictrain run`` agents of four workers each (c10d rendezvous on 127.0.0.1,
gloo) train tests/train_job.py with ``--exact``: each step's batch depends on the step
and the rank only, and every rank draws from its own RNG streams, so the run is
bit-exact only if every rank restores its own state. Rank 6 (on the second agent: not
rank 0, not rank 1, not the first agent's) is SIGKILLed by PID while every rank is
parked after a step drawn at random (5 to 25, a snapshot's); the agents restart all
eight workers, which resume from it.
Then both agents get SIGTERM: a final snapshot, exit 75. Two new agents resume it with
zero lost steps and run to the end. The final weights must equal those of a clean
eight-rank run of the same job (``params.digest``): an off-by-one in a rank range, a
collective only two ranks agree on or a rank restoring another's state breaks it.

The model has a weight and a bias: DDP lays out its gradient buckets anew after the
first step of every process, and with more than two ranks the order of a sum changes
its last bits; the snapshot records the rebuilt layout and every restore gives it back,
with the default settings (docs/scale.md#bit-exact-resume-above-two-ranks).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import TRAIN_JOB, child_env, events, free_port
from tests.processes.multinode.test_two_agents import kill_tree, port_open, wait_until

pytestmark = pytest.mark.distributed

AGENTS, PER_AGENT = 2, 4
WORLD = AGENTS * PER_AGENT
STEPS, EVERY, VICTIM = 40, 5, 6


class Launch:
    """Two agents of one job on this machine; every process they started is stopped."""

    def __init__(self, tmp_path: Path, root: Path, name: str, job_args: list[str]) -> None:
        self.port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        command = [sys.executable, "-m", "elastictrain.cli", "run", "--no-view",
                   "--nproc-per-node", str(PER_AGENT), "--nnodes", f"{AGENTS}:{AGENTS}",
                   "--max-restarts", "2", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id",
                   f"eight-{self.port}", str(TRAIN_JOB), str(root), str(STEPS), "--exact",
                   "--model", "linear", "--every", str(EVERY), *job_args]
        env = child_env(tmp_path, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                        ELASTICTRAIN_STORAGE__URL=str(root),
                        PYTHONPATH=os.pathsep.join([str(TRAIN_JOB.parents[1]),
                                                    os.environ.get("PYTHONPATH", "")]))
        for i in range(AGENTS):
            log = tmp_path / f"{name}-agent{i}.log"
            with open(log, "wb") as out:
                self.procs.append(subprocess.Popen(command, stdout=out,
                                                   stderr=subprocess.STDOUT, cwd=tmp_path,
                                                   env=env, start_new_session=True))
            self.logs.append(log)
            if i == 0:  # the rendezvous host listens before the other agent joins
                wait_until(lambda: port_open(self.port) or self.procs[0].poll() is not None,
                           120, "the first agent's rendezvous port")

    def wait(self, timeout: float) -> list[int]:
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=timeout))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"an agent did not end in {timeout} s:\n{self.tail()}"
                                     ) from None
        return codes

    def tail(self) -> str:
        return "\n".join(log.read_text(errors="replace")[-3000:] for log in self.logs)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
            proc.wait(timeout=30)


@pytest.fixture
def launches() -> Iterator[list[Launch]]:
    made: list[Launch] = []
    try:
        yield made
    finally:
        for launch in made:
            launch.stop()


def worker_events(root: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in events(root / "events", name) if e.get("role") != "agent"]


def finished_digest(root: Path) -> tuple[int, str]:
    (finished,) = worker_events(root, "run.finished")
    return finished["final_step"], finished["param_digest"]


def test_eight_ranks_survive_a_kill_and_a_preemption_bit_exactly(
        tmp_path: Path, launches: list[Launch]) -> None:
    clean_root, root, gates = tmp_path / "clean", tmp_path / "faulty", tmp_path / "gates"
    park = random.Random().choice(range(EVERY, 30, EVERY))
    # The reference, an uninterrupted run, alongside (its own rendezvous and storage).
    clean = Launch(tmp_path, clean_root, "clean", [])
    launches.append(clean)

    # 1. Every rank parks after that step (its snapshot committed); rank 6 is SIGKILLed.
    first = Launch(tmp_path, root, "first", ["--park", str(park), "--gates", str(gates),
                                             "--step-s", "0.2"])
    launches.append(first)
    parked = [gates / f"rank{r}.json" for r in range(WORLD)]
    wait_until(lambda: all(p.exists() for p in parked) or any(
        proc.poll() is not None for proc in first.procs), 240, "every rank parked")
    assert all(p.exists() for p in parked), first.tail()
    victim = json.loads((gates / f"rank{VICTIM}.json").read_text())["pid"]
    os.kill(victim, signal.SIGKILL)
    (gates / "go").write_text("")  # the restarted attempt does not park again

    # 2. All eight resume from it; once the next snapshot is committed, a preemption notice.
    def resumed() -> list[dict[str, Any]]:
        return [e for e in worker_events(root, "resume") if e.get("from_step") == park]

    wait_until(lambda: len(resumed()) >= WORLD, 180, f"eight ranks resumed from step {park}")
    assert sorted(e["rank"] for e in resumed()) == list(range(WORLD))
    assert {e["world_size"] for e in resumed()} == {WORLD}
    assert {e["rng"] for e in resumed()} == {"restored"}
    manifest = root / "snapshots" / f"step_{park + EVERY:012d}" / "MANIFEST.json"
    wait_until(manifest.exists, 180, f"the snapshot of step {park + EVERY}")
    for proc in first.procs:
        proc.send_signal(signal.SIGTERM)
    assert first.wait(timeout=180) == [75] * AGENTS, first.tail()
    (saved, *_) = worker_events(root, "preempt.saved")
    final = saved["snapshot_step"]
    assert park + EVERY <= final < STEPS

    # 3. Two new agents resume the final snapshot with nothing lost and run to the end.
    again = Launch(tmp_path, root, "again", ["--park", str(park), "--gates", str(gates)])
    launches.append(again)
    assert again.wait(timeout=240) == [0] * AGENTS, again.tail()
    # From the step of the final snapshot: the last step any rank took, nothing lost.
    last = [e for e in worker_events(root, "resume") if e.get("from_step") == final]
    assert sorted(e["rank"] for e in last) == list(range(WORLD))
    assert clean.wait(timeout=240) == [0] * AGENTS, clean.tail()
    # Both restarts gave every rank the rebuilt layout before its first step.
    given = [e for e in worker_events(root, "dist.bucket_layout") if e.get("installed")]
    assert sorted(e["rank"] for e in given) == sorted(list(range(WORLD)) * 2)
    assert finished_digest(root) == finished_digest(clean_root), f"parked after {park}"
    assert finished_digest(root)[0] == STEPS
