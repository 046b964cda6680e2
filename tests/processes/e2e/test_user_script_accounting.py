"""The README's example (examples/ddp_resumable.py), unmodified, under ``elastictrain run``
and under plain torchrun in the form the README gives: its events land beside its
snapshots, so ``status`` and ``goodput`` on the directory it was given see the run
finished, a worker SIGKILLed at step 12 (after the snapshot of step 10 committed) as
exactly 2 lost steps, and the automatic interval counts exactly the real failures. A
restore that fails the same way on every attempt (no numpy) is a crash loop:
``elastictrain run`` stops after two attempts with 78 and names the error.

The kill is deterministic without touching the script: a ``sitecustomize`` on the
workers' ``PYTHONPATH`` (tests/processes/e2e/user_script_hook) parks every rank after step 12
once the save of step 10 committed; the test then kills rank 1 by PID.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from elastictrain.snapshot.schedule.interval import failure_history
from tests.helpers import REPO, events, run_cli, started, wait_for

pytestmark = pytest.mark.distributed

SCRIPT = str(REPO / "examples" / "ddp_resumable.py")
HOOK = str(REPO / "tests" / "processes" / "e2e" / "user_script_hook")
FINAL_STEP = 48  # 3 epochs of 512 samples, 16 per rank and step, 2 ranks


def _command(launcher: str) -> list[str]:
    if launcher == "run":
        return [sys.executable, "-m", "elastictrain.cli", "run", "--nproc-per-node=2",
                "--no-view", SCRIPT, "ckpt"]
    # The form the README gives: --standalone, the variable exported (_env).
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1",
            "--log-dir=torchrun-logs", SCRIPT, "ckpt"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "ET_TEST_PARK_DIR": str(tmp_path),
            "PYTHONPATH": os.pathsep.join([HOOK, str(REPO)]), **extra}


def _run_dir(tmp_path: Path) -> Path:
    runs = list((tmp_path / "ckpt" / "events").iterdir())
    assert len(runs) == 1, runs
    return runs[0]


def _cli_json(tmp_path: Path, *args: str) -> dict[str, object]:
    result = run_cli([*args, "--json"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(json.loads(result.stdout))


def _check_accounting(tmp_path: Path, lost: int, failures: int) -> None:
    status = _cli_json(tmp_path, "status", "ckpt")
    assert status["finished"] == "finished" and status["step"] == FINAL_STEP, status
    assert status["world_size"] == 2 and status["lost_steps"] == lost
    goodput = _cli_json(tmp_path, "goodput", "ckpt")
    split = goodput["split"]
    assert isinstance(split, dict)
    assert goodput["final_step"] == FINAL_STEP and goodput["steps_lost"] == lost, goodput
    assert goodput["goodput"] == split["fractions"]["productive"]  # one figure
    assert [a["ended_by"] for a in split["attempts"]][-1] == "finished"
    assert [a["lost_steps"] for a in split["attempts"]] == [lost] * failures + [0]
    assert failure_history(_run_dir(tmp_path)).failures == failures


@pytest.mark.parametrize("launcher", ["run", "torchrun"])
def test_a_worker_killed_at_step_12_loses_exactly_2_steps(tmp_path: Path,
                                                          launcher: str) -> None:
    with started(_command(launcher), tmp_path, **_env(tmp_path, ET_TEST_PARK_AT="12")) as proc:
        parked = [tmp_path / f"parked-rank{r}" for r in (0, 1)]
        wait_for(lambda: all(p.exists() for p in parked), 240, "both ranks to park at 12")
        committed = [e["snapshot_step"] for e in events(tmp_path / "ckpt" / "events",
                                                        "snapshot.committed")]
        assert committed == [10]
        os.kill(int(parked[1].read_text()), signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, (tmp_path / "proc.log").read_text()[-3000:]
    resumes = [(e["rank"], e["from_step"], e["lost_steps"])
               for e in events(_run_dir(tmp_path), "resume") if e["restart_count"] == 1]
    assert sorted(resumes) == [(0, 10, 2), (1, 10, 2)]
    # One launch: every worker of both attempts has its id (under plain torchrun too).
    launches = {e["launch_id"] for e in events(_run_dir(tmp_path)) if "launch_id" in e}
    assert len(launches) == 1, launches
    assert [e["final_step"] for e in events(_run_dir(tmp_path), "run.finished")] == [FINAL_STEP]
    # Every 10 steps, and close() saves the last; the default retention keeps 3.
    assert sorted(int(p.name[5:]) for p in (tmp_path / "ckpt" / "snapshots").iterdir()
                  if p.name.startswith("step_")) == [30, 40, FINAL_STEP]
    # Nothing is left in the default location: under elastictrain run the launcher's
    # own files joined the workers' at the end.
    assert not (tmp_path / "elastictrain-run").exists()
    if launcher == "run":
        assert list(_run_dir(tmp_path).glob("agent-*.jsonl"))
    _check_accounting(tmp_path, lost=2, failures=1)


def test_the_same_restore_error_twice_is_a_crash_loop(tmp_path: Path) -> None:
    with started(_command("run"), tmp_path, **_env(tmp_path)) as proc:
        assert proc.wait(timeout=300) == 0, (tmp_path / "proc.log").read_text()[-3000:]
    # The same command again, now as an install without numpy: every restore fails alike.
    with started(_command("run"), tmp_path, "again.log", **_env(tmp_path, ET_TEST_NO_NUMPY="1")
                 ) as proc:
        assert proc.wait(timeout=300) == 78, (tmp_path / "again.log").read_text()[-3000:]
    out = (tmp_path / "again.log").read_text()
    assert "error:           RuntimeError: Numpy is not available" in out
    assert "sitecustomize.py:" in out and "crash loop:" in out and "fix:" in out
    agent = [e for e in events(tmp_path / "ckpt" / "events") if e.get("role") == "agent"]
    launch = agent[-1]["launch_id"]
    mine = [e for e in agent if e["launch_id"] == launch]
    assert [e["restart_count"] for e in mine if e["event"] == "agent.attempt_started"] == [0, 1]
    loop = [e for e in mine if e["event"] == "agent.crash_loop"]
    assert len(loop) == 1 and loop[0]["error"] == "RuntimeError" and loop[0]["failures"] == 2
    assert [e["outcome"] for e in mine if e["event"] == "agent.finished"] == ["crash_loop"]
