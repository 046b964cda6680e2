"""A resume at three and four ranks ends on the uninterrupted run's weights bit for bit,
with a model of several parameters (``Linear(8, 8)`` with its bias): DDP's bucket layout
differs between the first step of a process and the later ones, and above two ranks the
first step after a restart would round differently. By default the snapshot records
DDP's rebuilt layout and the restore gives it back (worker/bucket_layout.py); with
``dist.fixed_order_reduction`` every gradient is summed in rank order whatever the
layout (docs/scale.md#bit-exact-resume-above-two-ranks; eight ranks on two agents:
tests/processes/multinode/test_eight_ranks.py).

One agent, N workers, tests/train_job.py ``--exact`` (each step's batch a function of
the step and the rank). Every rank parks after a step drawn at random (its snapshot
committed); one rank, drawn too, is SIGKILLed by PID; the group restarts from that
snapshot and runs to the end."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import TRAIN_JOB, child_env, events, kill_session, wait_for

pytestmark = pytest.mark.distributed

STEPS, EVERY = 24, 1


def _launch(tmp_path: Path, root: Path, ranks: int, fixed: bool, *job_args: str
            ) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "elastictrain.cli", "run", "--no-view",
               "--nproc-per-node", str(ranks), "--max-restarts", "1", str(TRAIN_JOB),
               str(root), str(STEPS), "--exact", "--model", "linear", "--every", str(EVERY),
               *job_args]
    env = child_env(tmp_path, ELASTICTRAIN_STORAGE__URL=str(root),
                    ELASTICTRAIN_DIST__FIXED_ORDER_REDUCTION="1" if fixed else "0",
                    PYTHONPATH=os.pathsep.join([str(TRAIN_JOB.parents[1]),
                                                os.environ.get("PYTHONPATH", "")]))
    log = open(tmp_path / f"{root.name}.log", "wb")  # noqa: SIM115 - the child holds it
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                            env=env, start_new_session=True)


def _digest(root: Path) -> tuple[int, str]:
    (finished,) = [e for e in events(root / "events", "run.finished")
                   if e.get("role") != "agent"]
    return finished["final_step"], finished["param_digest"]


@pytest.mark.parametrize(("ranks", "reduction"), [(3, "layout"), (4, "layout"),
                                                  (4, "fixed order")])
def test_a_kill_at_a_random_step_resumes_bit_exactly(tmp_path: Path, ranks: int,
                                                     reduction: str) -> None:
    draw = random.Random()
    # From step 2: DDP rebuilds its buckets at the second step's forward pass, and the
    # snapshot of step 1 has no layout to record (docs/scale.md).
    park, victim = draw.randint(2, STEPS - 2), draw.randrange(ranks)
    why = f"{ranks} ranks, {reduction}, parked after step {park}, rank {victim} killed"
    gates, fixed = tmp_path / "gates", reduction == "fixed order"
    clean = _launch(tmp_path, tmp_path / "clean", ranks, fixed)
    faulty = _launch(tmp_path, tmp_path / "faulty", ranks, fixed, "--park", str(park),
                     "--gates", str(gates))
    try:
        parked = [gates / f"rank{r}.json" for r in range(ranks)]
        wait_for(lambda: all(p.exists() for p in parked) or faulty.poll() is not None, 240,
                 f"every rank parked ({why})")
        assert faulty.poll() is None, (tmp_path / "faulty.log").read_text()[-3000:]
        os.kill(json.loads(parked[victim].read_text())["pid"], signal.SIGKILL)
        (gates / "go").write_text("")  # the restarted group does not park again
        assert faulty.wait(timeout=240) == 0, (tmp_path / "faulty.log").read_text()[-3000:]
        assert clean.wait(timeout=240) == 0, (tmp_path / "clean.log").read_text()[-3000:]
    finally:
        for proc in (clean, faulty):
            kill_session(proc)
    resumes = [e for e in events(tmp_path / "faulty" / "events", "resume")
               if e.get("from_step") == park]
    assert sorted(e["rank"] for e in resumes) == list(range(ranks)), why
    if fixed:
        registered = events(tmp_path / "faulty" / "events", "dist.reduction_order")
        assert registered and all(e["fixed"] for e in registered), why
    else:  # every rank of the restarted group reduced its first step in the rebuilt layout
        given = [e for e in events(tmp_path / "faulty" / "events", "dist.bucket_layout")
                 if e.get("installed")]
        assert sorted(e["rank"] for e in given) == list(range(ranks)), why
    assert _digest(tmp_path / "faulty") == _digest(tmp_path / "clean"), why
