"""Per-rank state under real ``elastictrain run`` (two gloo workers, CPU): each rank's
data position lives in a torchdata ``StatefulDataLoader`` (two loader workers,
prefetching) passed as ``state=``. Rank 1 is SIGKILLed in the middle of step 13; the
restart resumes the newest snapshot on both ranks (step 12, or one before it when 12
was still being written), each loader at its own next batch, and the final weights
equal an uninterrupted run's: from durable storage (a snapshot every 4 steps), and from
node memory (a memory snapshot every step), where a rescue refuses (the step records
hold no per-rank state)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastictrain.launcher.spawn import DEFAULT_RDZV_CONF, LaunchSpec, start_torchrun
from tests.helpers import REPO, events, kill_session

pytestmark = pytest.mark.distributed

JOB = REPO / "tests" / "processes" / "memtier" / "loader_job.py"
EPOCHS, DIE_IN = 2, 13  # 10 steps an epoch
# Durable every 4 steps: the newest before the kill is 12; or durable every 10 and a
# memory snapshot every step: the newest is 12 in node memory.
POLICIES = {"durable": {"ELASTICTRAIN_SNAPSHOT__EVERY_STEPS": "4"},
            "memory": {"ELASTICTRAIN_SNAPSHOT__EVERY_STEPS": "10",
                       "ELASTICTRAIN_SNAPSHOT__MEMORY_EVERY": "1"}}


def launch(tmp_path: Path, name: str, *job_args: str, policy: str = "memory"
           ) -> tuple[subprocess.Popen[bytes], Path]:
    ev = tmp_path / name / "ev"
    ev.mkdir(parents=True)
    spec = LaunchSpec(nproc_per_node=2, script=str(JOB), max_restarts=2,
                      script_args=[str(tmp_path / name / "run"), str(EPOCHS), *job_args],
                      rdzv_id=f"loader-{name}-{tmp_path.name}", rdzv_conf=DEFAULT_RDZV_CONF,
                      log_dir=str(ev / "torchelastic"), events_dir=str(ev))
    with open(tmp_path / name / "launcher.log", "wb") as log:
        proc = start_torchrun(spec, stdout=log.fileno(), extra_env={
            "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1",
            "ELASTICTRAIN_SNAPSHOT__MEMORY_DIR": str(tmp_path / name / "mem"),
            **POLICIES[policy]})
    return proc, ev


def finish(proc: subprocess.Popen[bytes], tmp_path: Path, name: str) -> None:
    try:
        code = proc.wait(timeout=240)
    finally:
        kill_session(proc)
    log = (tmp_path / name / "launcher.log").read_text(errors="replace")[-3000:]
    assert code == 0, log


def digest(ev: Path) -> str:
    (found,) = [e["param_digest"] for e in events(ev, "params.digest")]
    return str(found)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The final weights' digest of an uninterrupted run (its snapshot policy changes
    nothing it trains)."""
    tmp = tmp_path_factory.mktemp("loader-reference")
    ref, ev = launch(tmp, "ref")
    finish(ref, tmp, "ref")
    yield digest(ev)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tier", ["durable", "memory"])
def test_a_killed_rank_resumes_its_loader_bit_exact(tmp_path: Path, reference: str,
                                                    tier: str) -> None:
    run, ev = launch(tmp_path, "run", str(DIE_IN), policy=tier)
    finish(run, tmp_path, "run")

    # The newest snapshot the first attempt committed: 12, or one before it when the
    # kill came while step 12's save was still being written (it dies with the process).
    newest = max(e["snapshot_step"] for e in events(ev, "snapshot.committed")
                 if e["restart_count"] == 0 and e["tier"] == tier)
    assert newest > 10 if tier == "memory" else newest >= 8  # in the second epoch's middle
    resumes = [e for e in events(ev, "resume") if e["restart_count"] == 1]
    assert sorted((e["rank"], e["from_step"], e["tier"]) for e in resumes) == \
        [(0, newest, tier), (1, newest, tier)]
    assert digest(ev) == reference  # bit-exact
    # The survivor meets the death only once the killed rank's loader workers have
    # ended (about 5 s); the agent may stop it before its rescue begins. One that began
    # refuses.
    for skipped in events(ev, "snapshot.rescue_skipped"):
        assert "per-rank state" in skipped["reason"]
