"""Preemption with sharded state under a real torchrun agent (`elastictrain run`, 2 gloo
ranks, examples/fsdp_resumable.py): SIGTERM by PID to the launcher, which forwards it.
Every rank takes part in the final sharded snapshot, it commits, exit 75, and the
relaunch resumes from it with 0 lost steps, bit-exact with an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from elastictrain.core.errors import EXIT_PREEMPTED_UNSAVED
from tests.helpers import REPO, wait_for
from tests.processes.e2e.test_preemption import Job, assert_preempted, assert_preempted_unsaved
from tests.processes.sharded.test_fsdp_e2e import samples_per_step

pytestmark = pytest.mark.distributed

EXAMPLE = REPO / "examples" / "fsdp_resumable.py"


class FsdpJob(Job):
    """examples/fsdp_resumable.py under `elastictrain run`; rank 0's record in ``rec``."""

    entrypoint = EXAMPLE.name

    def __init__(self, tmp_path: Path, **env: str) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        super().__init__(tmp_path, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **env)
        self.record = tmp_path / "rec"

    def argv(self, steps: int, *extra: str) -> list[str]:
        return ["--nproc-per-node=2", "--max-restarts=0", f"--log-dir={self.tmp / 'logs'}",
                str(EXAMPLE), str(self.storage), f"--steps={steps}", "--every=5",
                f"--record={self.record}", *extra]

    def final(self) -> dict[str, Any]:
        return dict(json.loads((self.record / "final.json").read_text()))


def test_sigterm_saves_a_sharded_snapshot_on_every_rank_and_resumes_bit_exact(
        tmp_path: Path) -> None:
    job = FsdpJob(tmp_path / "preempted")
    with job.start(steps=100_000) as launcher:
        wait_for(lambda: job.committed(10), 180, "the first sharded snapshots")
        os.kill(launcher.pid, signal.SIGTERM)
        code = launcher.wait(timeout=240)
    step = assert_preempted(job, code)  # both ranks saved the same step; it committed
    staged = {e["rank"] for e in job.of("snapshot.staged") if e["snapshot_step"] == step}
    assert staged == {0, 1}  # every rank wrote its part of the final snapshot
    assert {e.get("rank") for e in job.of("snapshot.committed")} == {0}  # rank 0 commits
    manifest = json.loads((job.storage / "snapshots" / f"step_{step:012d}" /
                           "MANIFEST.json").read_text())
    assert {o["rank"] for o in manifest["objects"] if o["name"].endswith(".distcp")} == {0, 1}
    assert not (job.record / "final.json").exists()
    # The example records a step after snap.step(), which raised at `step`: 1 … step-1.
    assert max(samples_per_step(job.record)) == step - 1
    result = job.run(steps=step + 3)
    assert result.returncode == 0, result.stderr[-4000:]
    assert job.final()["resumed_from"] == step  # 0 lost steps: the step it stopped at
    assert job.final()["step"] == step + 3

    reference = FsdpJob(tmp_path / "reference")
    result = reference.run(steps=step + 3)
    assert result.returncode == 0, result.stderr[-4000:]
    assert reference.final()["resumed_from"] is None
    seen, ref_samples = samples_per_step(job.record), samples_per_step(reference.record)
    assert sorted(seen) == [s for s in range(1, step + 4) if s != step]  # (step: unrecorded)
    assert seen == {s: ref_samples[s] for s in seen}  # the same data at every step
    assert job.final()["params_sha256"] == reference.final()["params_sha256"]  # bit-exact


def test_notice_while_a_sharded_save_is_failing_still_attempts_the_final_one_and_exits_76(
        tmp_path: Path) -> None:
    # Every storage write fails, 3 s after it starts (storage faults, configured by
    # environment only). The save of step 5 is in flight and failing when the notice
    # comes; training has reached step 10, whose save waits for it (back-pressure).
    faults = json.dumps({"write_error_p": 1.0, "latency_s": 3.0})
    job = FsdpJob(tmp_path, ELASTICTRAIN_STORAGE__FAULTS=faults)
    with job.start(steps=100_000) as launcher:
        wait_for(lambda: launcher.poll() is not None or (
            (job.record / "steps.jsonl").exists() and 9 in samples_per_step(job.record)),
            180, "step 9, with the save of step 5 in flight")
        os.kill(launcher.pid, signal.SIGTERM)
        code = launcher.wait(timeout=240)
    step = assert_preempted_unsaved(job, code, "injected fault")
    staged = {(e["rank"], e["snapshot_step"]) for e in job.of("snapshot.staged")}
    assert {(0, step), (1, step)} <= staged  # the final snapshot was attempted on every rank
    assert step == 10  # the step whose save was waiting when the notice came
    failures = {(e["rank"], e["snapshot_step"]) for e in job.of("snapshot.failed")}
    assert failures == {(0, 5), (1, 5), (0, 10), (1, 10)}  # in flight, then the final one
    assert not list(job.storage.glob("snapshots/*/MANIFEST.json"))
    finished = job.of("agent.finished")
    assert finished[-1]["exit_code"] == EXIT_PREEMPTED_UNSAVED
