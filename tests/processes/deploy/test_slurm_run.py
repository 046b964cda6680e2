"""deploy/slurm/train.sbatch on a real single-node Slurm (scripts/slurm_local.sh):
preemption notices by USR1 to the step and to the batch shell (the B:USR1 form), a final
snapshot, exit 75, a requeue under the same job id, a resume with 0 lost steps, a new
attempt in the event log with the pending gap; a notice while the store fails exits 76,
is requeued and resumes from the snapshot before; a config error exits 78, not requeued;
the README's example as a user's script to its end, on a local directory and on S3.

Runs wherever the Slurm and munge binaries are on PATH (about 2 minutes here)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastictrain.runlog.goodput import compute_goodput
from tests.helpers import (
    FAULTS_JOB_OPTIONS,
    REPO,
    TRAIN_JOB,
    child_env,
    events,
    free_port,
    wait_for,
)
from tests.s3server import S3Bucket, assert_no_secret

SLURM_BINARIES = ("sbatch", "scontrol", "slurmctld", "slurmd", "munged")
_MISSING = [b for b in SLURM_BINARIES if shutil.which(b) is None]
SBATCH = REPO / "deploy" / "slurm" / "train.sbatch"
SCRIPT = REPO / "scripts" / "slurm_local.sh"
pytestmark = [
    pytest.mark.deploy,
    pytest.mark.skipif(bool(_MISSING), reason=f"needs Slurm and munge ({', '.join(_MISSING)} "
                       "not on PATH): apt-get install -y slurm-wlm munge"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the local Slurm daemons run as root"),
    pytest.mark.timeout(600),  # a job, a requeue hold and a second job, on a loaded machine
    pytest.mark.xdist_group("slurm"),  # one local cluster (the module's) for all of them
]

@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A running local cluster; yields the environment that reaches it."""
    cluster = tmp_path_factory.mktemp("slurm")
    up = subprocess.run([str(SCRIPT), "up", str(cluster)], capture_output=True, text=True,
                        timeout=120)
    try:
        assert up.returncode == 0, up.stderr
        yield {"SLURM_CONF": str(cluster / "slurm.conf")}
    finally:
        subprocess.run([str(SCRIPT), "down", str(cluster)], timeout=120, check=False)


def _env(tmp_path: Path, slurm: dict[str, str], **extra: str) -> dict[str, str]:
    return child_env(tmp_path, PYTHONPATH=str(REPO), NPROC_PER_NODE="2",
                     RDZV_PORT=str(free_port()), ELASTICTRAIN_STORAGE__URL=str(tmp_path / "run"),
                     **slurm, **extra)


def _submit(tmp_path: Path, env: dict[str, str], *script_args: str) -> str:
    cpus = str(os.cpu_count())
    out = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0",
                          f"--cpus-per-task={cpus}", f"--output={tmp_path}/job-%j.log",
                          str(SBATCH), *script_args],
                         env=env, capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip().split(";")[0]


def _job(job: str, env: dict[str, str]) -> dict[str, str]:
    """``scontrol show job`` as a dict; empty when slurmctld does not answer (a busy
    controller is retried by the caller's wait, not failed)."""
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                         text=True, timeout=30, check=False)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout)) if out.returncode == 0 else {}


def _wait_job(job: str, env: dict[str, str], what: str, timeout: float,
              **fields: str) -> dict[str, str]:
    """Wait until the job shows every ``fields`` value at once; return that view."""
    seen: dict[str, str] = {}

    def matches() -> bool:
        nonlocal seen
        seen = _job(job, env)
        return all(seen.get(k) == v for k, v in fields.items())

    try:
        wait_for(matches, timeout, what, interval=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: wanted {fields}, last seen {_brief(seen)}") from None
    return seen


def _brief(info: dict[str, str]) -> dict[str, str]:
    keys = ("JobState", "Reason", "ExitCode", "Restarts", "EligibleTime")
    return {k: info[k] for k in keys if k in info}


def _cancel(job: str, env: dict[str, str]) -> None:
    subprocess.run(["scancel", job], env=env, timeout=30, check=False)


def _demo_args(tmp_path: Path) -> list[str]:
    return ["-m", "elastictrain.demo.worker", f"--storage={tmp_path / 'run'}", "--steps=200",
            "--snapshot-every=20"]


def _events(tmp_path: Path, job: str, name: str) -> list[dict[str, Any]]:
    root = tmp_path / "run" / "events" / job
    return events(root, name) if root.exists() else []


def _requeued(tmp_path: Path, job: str, env: dict[str, str], exit_code: int) -> None:
    """The first run ended with ``exit_code`` and Slurm requeued the job under its id.

    The launcher's own record of its exit, not the job's ExitCode: that one reads the
    code only while the job is pending (slurm_local.sh's 10 s hold), a window a slow
    poll on a loaded machine may miss."""
    _wait_job(job, env, "the requeue", 120, Restarts="1")
    first = _events(tmp_path, job, "agent.finished")[0]  # files sort by launch time
    assert first["exit_code"] == exit_code, first
    # Every worker exited by itself with that code: none hung after its final snapshot
    # and had to be killed by the launcher (elastictrain.worker.dist.quiesce).
    stopped = _events(tmp_path, job, "agent.workers_stopped")[0]
    assert set(stopped["exit_codes"].values()) == {exit_code}, stopped


@pytest.mark.parametrize("signal_to", ["step", "batch"])
@pytest.mark.distributed  # sbatch, srun, elastictrain run
def test_usr1_gives_final_snapshot_exit_75_requeue_and_resume_without_loss(
        tmp_path: Path, slurm: dict[str, str], signal_to: str) -> None:
    env = _env(tmp_path, slurm)
    job = _submit(tmp_path, env, *_demo_args(tmp_path))
    try:
        wait_for(lambda: any(e["rank"] == 0 for e in _events(tmp_path, job, "resume")),
                 180, "the first step")
        # --cpus-per-task reaches the step: a worker may use every CPU, not one.
        pid = next(e["pid"] for e in _events(tmp_path, job, "worker.start") if e["rank"] == 0)
        allowed = Path(f"/proc/{pid}/status").read_text()
        assert f"Cpus_allowed_list:\t0-{os.cpu_count() - 1}" in allowed  # type: ignore[operator]

        # "batch": what --signal=B:USR1@N delivers (to the batch shell only, trapped there).
        target = ["--batch"] if signal_to == "batch" else []
        subprocess.run(["scancel", *target, "--signal=USR1", job], env=env, timeout=30,
                       check=True)
        _requeued(tmp_path, job, env, 75)
        (saved,) = [e for e in _events(tmp_path, job, "preempt.saved") if e["rank"] == 0]
        assert saved["within_grace"] is True
        # Slurm starts it again by itself once the hold is over (never `StartTime=now`:
        # docs/deploy.md).
        _wait_job(job, env, "the requeued job to finish", 300, JobState="COMPLETED")
    finally:
        _cancel(job, env)
    resumes = [e for e in _events(tmp_path, job, "resume") if e["rank"] == 0]
    assert len(resumes) == 2
    assert resumes[1]["from_step"] == saved["snapshot_step"] and resumes[1]["lost_steps"] == 0
    assert resumes[1]["launch_id"] != resumes[0]["launch_id"]
    assert resumes[1]["slurm_restart_count"] == 1
    report = compute_goodput(tmp_path / "run" / "events" / job)
    assert report.attempts == 2 and report.final_step == 200 and report.steps_lost == 0
    assert report.pending_s > 0


@pytest.mark.distributed  # sbatch, srun, elastictrain run
def test_notice_while_the_store_fails_exits_76_is_requeued_and_resumes_from_the_last_commit(
        tmp_path: Path, slurm: dict[str, str]) -> None:
    switch = tmp_path / "fail-switch"  # tests/train_job.py: writes fail while it exists
    env = _env(tmp_path, slurm, FAULTS_JOB_FAIL_WHILE=str(switch), FAULTS_JOB_STEP_S="0.02",
               ELASTICTRAIN_SNAPSHOT__EVERY_STEPS="20",
               ELASTICTRAIN_SNAPSHOT__RETRY_BACKOFF_S="0.5")
    job = _submit(tmp_path, env, str(TRAIN_JOB), str(tmp_path / "run"),
                  "300", *FAULTS_JOB_OPTIONS)

    def committed() -> list[int]:
        return [e["snapshot_step"] for e in _events(tmp_path, job, "snapshot.committed")
                if e["rank"] == 0]

    try:
        wait_for(lambda: bool(committed()), 180, "a first snapshot")
        switch.touch()
        subprocess.run(["scancel", "--signal=USR1", job], env=env, timeout=30, check=True)
        wait_for(lambda: _events(tmp_path, job, "preempt.failed"), 120, "the final snapshot "
                 "to fail")
        switch.unlink()  # the store is back before the requeued job starts
        _requeued(tmp_path, job, env, 76)
        newest = max(committed())
        _wait_job(job, env, "the requeued job to finish", 300, JobState="COMPLETED")
    finally:
        _cancel(job, env)
    failed = [e for e in _events(tmp_path, job, "preempt.failed") if e["rank"] == 0]
    assert failed[0]["snapshot_step"] > newest
    resumes = [e for e in _events(tmp_path, job, "resume") if e["rank"] == 0]
    assert [r["slurm_restart_count"] for r in resumes[1:]] == [1]
    assert resumes[1]["from_step"] == newest  # the snapshot before the failed one


@pytest.mark.distributed  # sbatch, srun, elastictrain run
def test_config_error_exits_78_and_is_not_requeued(tmp_path: Path, slurm: dict[str, str]) -> None:
    env = _env(tmp_path, slurm, ELASTICTRAIN_SNAPSHOT__KEEP="0")
    job = _submit(tmp_path, env, *_demo_args(tmp_path))
    try:
        info = _wait_job(job, env, "the job to fail", 120, JobState="FAILED")
        assert (info["ExitCode"], info["Restarts"]) == ("78:0", "0")
    finally:
        _cancel(job, env)
    log = (tmp_path / f"job-{job}.log").read_text()
    assert "snapshot.keep" in log




@pytest.mark.distributed  # sbatch, srun, elastictrain run
def test_the_users_script_runs_to_its_end_with_node_memory(tmp_path: Path,
                                                           slurm: dict[str, str]) -> None:
    """docs/cluster.md's Slurm line: the README's example (a user's script) with its
    storage as its argument, node memory on by the recipe's default, to a clean end."""
    env = _env(tmp_path, slurm)
    job = _submit(tmp_path, env, str(REPO / "examples" / "ddp_resumable.py"),
                  str(tmp_path / "run"))
    try:
        _wait_job(job, env, "the job's end", 300, JobState="COMPLETED")
    finally:
        _cancel(job, env)
    (finished,) = [e for e in _events(tmp_path, job, "run.finished") if e.get("rank") == 0]
    assert finished["final_step"] == 48  # 3 epochs of 512 samples, 16 per rank, 2 ranks
    assert [e for e in _events(tmp_path, job, "snapshot.interval") if e.get("tier") == "memory"]
    assert json.loads((tmp_path / "run" / "RUN").read_text())["run_id"] == job


@pytest.mark.s3
@pytest.mark.distributed
def test_the_users_script_runs_to_its_end_on_s3_with_node_memory(
        tmp_path: Path, slurm: dict[str, str], s3: S3Bucket) -> None:
    """The same on S3 (moto on 127.0.0.1; the credentials through the environment, as
    the Kubernetes recipe's Secret gives them): snapshots, the run's marker and every
    event file end in the bucket, node memory on, and the credentials in no file."""
    env = _env(tmp_path, slurm, **s3.env, AWS_ENDPOINT_URL=s3.server.endpoint)
    url = s3.url("run")
    env["ELASTICTRAIN_STORAGE__URL"] = url
    job = _submit(tmp_path, env, str(REPO / "examples" / "ddp_resumable.py"), url)
    try:
        _wait_job(job, env, "the job's end", 300, JobState="COMPLETED")
    finally:
        _cancel(job, env)
    keys = s3.keys("run/")
    assert "run/RUN" in keys, keys
    client = s3.server.client()
    marker = client.get_object(Bucket=s3.name, Key="run/RUN")["Body"].read()
    assert json.loads(marker)["run_id"] == job
    assert any(k.endswith("/MANIFEST.json") for k in keys), keys
    uploaded = [k for k in keys if k.startswith(f"run/events/{job}/") and k.endswith(".jsonl")]
    assert any("agent-" in k for k in uploaded) and any("rank0" in k for k in uploaded), keys
    finished = [json.loads(line) for k in uploaded if "rank0" in k
                for line in client.get_object(Bucket=s3.name, Key=k)["Body"].read().splitlines()
                if b'"run.finished"' in line]
    assert [e["final_step"] for e in finished] == [48]
    intervals = [k for k in uploaded if "rank" in k
                 for line in client.get_object(Bucket=s3.name, Key=k)["Body"].read().splitlines()
                 if b'"snapshot.interval"' in line and b'"memory"' in line]
    assert intervals, "node memory was not on"
    logs = [p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file()
            and p.suffix in (".log", ".jsonl", ".json")]
    assert_no_secret(*logs, where="the job's files")
