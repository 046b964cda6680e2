"""A restore checked for sense, end to end (docs/restore.md#checked-for-sense): a run of
tests/train_job.py on two ranks finishes; its newest snapshot is then rewritten with a
valid checksum to hold NaN weights (under ``elastictrain run``) or a diverged model
(under plain torchrun), and the same job relaunched with more steps sets it aside, falls
back to the snapshot before and ends on the weights of a run that never met it. A rank
whose arithmetic goes wrong after every restore makes each fallback suspect too: past
``snapshot.check_max_fallbacks`` the launcher exits 78 naming the suspect steps."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastictrain.snapshot.durable.suspects import suspects
from elastictrain.storage import open_store
from tests.helpers import TRAIN_JOB, child_env, events, kill_session, run_cli
from tests.planted import rewrite_payload

pytestmark = pytest.mark.distributed

EVERY = 5


def _launch(tmp_path: Path, root: Path, steps: int, *job_args: str, launcher: str = "run",
            **env: str) -> subprocess.CompletedProcess[str]:
    job = [str(TRAIN_JOB), str(root), str(steps), "--exact", "--model", "linear", "--every",
           str(EVERY), "--loss", *job_args]
    if launcher == "run":
        command = [sys.executable, "-m", "elastictrain.cli", "run", "--no-view",
                   "--nproc-per-node", "2", "--max-restarts", "3", *job]
    else:  # the README's form of plain torchrun, with the variable it exports
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", "--max-restarts", "3", *job]
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env}
    full_env = child_env(tmp_path, ELASTICTRAIN_STORAGE__URL=str(root),
                         PYTHONPATH=os.pathsep.join([str(TRAIN_JOB.parents[1]),
                                                     os.environ.get("PYTHONPATH", "")]),
                         **env)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp_path, env=full_env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        kill_session(proc)
    return subprocess.CompletedProcess(command, proc.returncode, out, "")


def _final(root: Path) -> tuple[int, str]:
    finished = [e for e in events(root / "events", "run.finished") if e.get("role") != "agent"
                and e.get("rank") == 0]
    return finished[-1]["final_step"], finished[-1]["param_digest"]


def _resumed_from(root: Path) -> list[Any]:
    return [e["from_step"] for e in events(root / "events", "resume") if e.get("rank") == 0]


@pytest.fixture(scope="module")
def clean_final(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str]:
    """The final step and weights of the job run to 30 steps without a fault (the same
    under either launcher: every step's batch is a function of the step and the rank)."""
    where = tmp_path_factory.mktemp("clean")
    assert _launch(where, where / "run", 30).returncode == 0
    return _final(where / "run")


@pytest.mark.xdist_group("sense-check")  # one clean run for both
@pytest.mark.parametrize(("launcher", "plant"), [("run", "nan"), ("torchrun", "diverged"),
                                                ("run", "diverged, node memory")])
def test_a_senseless_newest_snapshot_is_set_aside_and_the_run_ends_right(
        tmp_path: Path, launcher: str, plant: str, clean_final: tuple[int, str],
        shm: Path) -> None:
    """With node memory (a memory snapshot every step, and the rescue armed) the steps
    trained on the suspect state must not come back from memory: not its memory copies,
    not a rescue of its last step by the error that ends the attempt."""
    faulty = tmp_path / "faulty"
    memory = ["--memory-every", "1"] if "memory" in plant else []
    first = _launch(tmp_path, faulty, 20, *memory, launcher=launcher)
    assert first.returncode == 0, first.stdout[-3000:]
    change = ((lambda name, t: t.fill_(math.nan)) if plant == "nan"
              else (lambda name, t: t * 40))
    rewrite_payload(open_store(str(faulty)), 20, change)  # verifies; makes no sense
    again = _launch(tmp_path, faulty, 30, *memory, launcher=launcher)
    assert again.returncode == 0, again.stdout[-3000:]
    # Found at the restore (NaN) or by the median loss of the first five steps; the next
    # attempt restored the snapshot before and trained on to the end.
    [seen] = [e for e in events(faulty / "events", "snapshot.suspect") if e.get("rank") == 0]
    assert seen["snapshot_step"] == 20 and seen["restore_next"] == 15, seen
    assert seen["at_step"] == (20 if plant == "nan" else 25), seen
    assert not [e for e in events(faulty / "events", "snapshot.rescued")]
    assert _resumed_from(faulty)[-2:] == [20, 15]
    assert _final(faulty) == clean_final  # the weights of a run that never met it
    records = {r.step: r for r in suspects(open_store(str(faulty)))}
    assert records[20].descends_from is None and records[20].moved_to
    listed = run_cli(["snapshots", "list", str(faulty), "--json"], tmp_path)
    assert {"step": 20, "status": "suspect"}.items() <= next(
        r for r in json.loads(listed.stdout) if r["status"] == "suspect").items()
    status = run_cli(["status", str(faulty)], tmp_path)
    assert "suspect snapshot, set aside: step 20" in status.stdout, status.stdout
    goodput = run_cli(["goodput", str(next((faulty / "events").iterdir())), "--json"],
                      tmp_path)
    assert goodput.returncode == 0, goodput.stderr
    if plant != "nan":  # 5 steps trained on it, then thrown away
        assert json.loads(goodput.stdout)["suspect_s"] > 0


def test_a_rank_computing_wrong_after_every_restore_stops_the_run_with_78(
        tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert _launch(tmp_path, root, 20).returncode == 0
    again = _launch(tmp_path, root, 30, "--wrong-rank", "1",
                    ELASTICTRAIN_SNAPSHOT__CHECK_MAX_FALLBACKS="1")
    assert again.returncode == 78, again.stdout[-3000:]
    assert "2 snapshots in a row were set aside (steps 15, 20" in again.stdout, \
        again.stdout[-3000:]
    seen = [e for e in events(root / "events", "snapshot.suspect") if e.get("rank") == 0]
    assert [(e["snapshot_step"], e["at_step"], e["action"]) for e in seen] == [
        (20, 21, "set aside; restarting from the snapshot before"), (15, 16, "stopped")]
    assert [r.step for r in suspects(open_store(str(root)))] == [15, 20]  # kept, both
