"""Per-rank state under real ``elastictrain run`` (two gloo workers, CPU): each rank's
data position lives in a torchdata ``StatefulDataLoader`` (two loader workers,
prefetching) passed as ``state=``, with a memory snapshot every step. Rank 1 is
SIGKILLed in the middle of step 13: the survivor's rescue refuses (the step records
hold no per-rank state), the restart resumes step 12 from node memory on both ranks,
each loader at its own next batch, and the final weights equal an uninterrupted run's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from elastictrain.launcher.spawn import DEFAULT_RDZV_CONF, LaunchSpec, start_torchrun
from tests.helpers import REPO, events, kill_session

pytestmark = pytest.mark.distributed

JOB = REPO / "tests" / "processes" / "memtier" / "loader_job.py"
EPOCHS, DIE_IN = 2, 13  # 10 steps an epoch; durable snapshots at 10 and 20


def launch(tmp_path: Path, name: str, *job_args: str) -> tuple[subprocess.Popen[bytes], Path]:
    ev = tmp_path / name / "ev"
    ev.mkdir(parents=True)
    spec = LaunchSpec(nproc_per_node=2, script=str(JOB), max_restarts=2,
                      script_args=[str(tmp_path / name / "run"), str(EPOCHS), *job_args],
                      rdzv_id=f"loader-{name}-{tmp_path.name}", rdzv_conf=DEFAULT_RDZV_CONF,
                      log_dir=str(ev / "torchelastic"), events_dir=str(ev))
    with open(tmp_path / name / "launcher.log", "wb") as log:
        proc = start_torchrun(spec, stdout=log.fileno(), extra_env={
            "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1",
            "ELASTICTRAIN_SNAPSHOT__EVERY_STEPS": "10",
            "ELASTICTRAIN_SNAPSHOT__MEMORY_EVERY": "1",
            "ELASTICTRAIN_SNAPSHOT__MEMORY_DIR": str(tmp_path / name / "mem")})
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


@pytest.mark.timeout(600)
def test_a_killed_rank_resumes_its_loader_from_node_memory_bit_exact(tmp_path: Path) -> None:
    ref, ref_ev = launch(tmp_path, "ref")
    finish(ref, tmp_path, "ref")
    run, ev = launch(tmp_path, "run", str(DIE_IN))
    finish(run, tmp_path, "run")

    skipped = events(ev, "snapshot.rescue_skipped")
    assert [e["rank"] for e in skipped] == [0] and "per-rank state" in skipped[0]["reason"]
    resumes = [e for e in events(ev, "resume") if e["restart_count"] == 1]
    assert sorted((e["rank"], e["from_step"], e["tier"]) for e in resumes) == \
        [(0, DIE_IN - 1, "memory"), (1, DIE_IN - 1, "memory")]
    assert digest(ev) == digest(ref_ev)  # bit-exact
