"""`elastictrain run` in a real terminal (tmux): the live view of a script of unknown
length, Ctrl-C → final snapshot → exit 75 with no process left; off a terminal the
output is torchrun's as before. Real torchrun, two gloo workers."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from elastictrain.core import layout
from elastictrain.core.errors import EXIT_PREEMPTED
from tests.helpers import REPO, descendants, events, pid_alive, run_cli, wait_for
from tests.processes.view.terminal import Tmux

pytestmark = pytest.mark.distributed

JOB = REPO / "tests" / "processes" / "view" / "endless_job.py"


def test_run_shows_the_live_view_and_ctrl_c_stops_with_a_final_snapshot(
        tmp_path: Path, tmux: Tmux) -> None:
    ckpt, ev = tmp_path / "ckpt", tmp_path / "elastictrain-run" / "events"
    # pytest exports COLUMNS=80 and LINES=24, which rich would take over the pane's size.
    env = (f"-u COLUMNS -u LINES PYTHONPATH={os.environ.get('PYTHONPATH', '')} "
           f"TMPDIR={tmp_path} ELASTICTRAIN_SNAPSHOT__PROGRESS_EVERY_S=1")
    tmux.start(f"cd {tmp_path} && env {env} elastictrain run --nproc-per-node 2 {JOB} {ckpt}; "
               "echo RUN-EXIT=$?; sleep 600")  # the sleep keeps the pane readable after it
    pids: set[int] = set()
    try:
        # The area: title with attempt and world size, step and rate (no total known),
        # the newest snapshot, and where the output went.
        wait_for(lambda: "steps/s" in tmux.pane() and "snapshot  step " in tmux.pane(), 180,
                 "step, rate and a snapshot in the view", interval=0.3)
        screen = tmux.pane()
        assert "attempt 0  world size 2" in screen, screen
        assert "worker logs" in screen and "launcher log" in screen, screen
        assert "Ctrl-C stops the job" in screen, screen
        launcher = [int(e["pid"]) for e in events(ev, "agent.start")]
        assert len(launcher) == 1
        workers = {int(p) for e in events(ev, "agent.attempt_started") for p in e["pids"].values()}
        pids = set(descendants(launcher[0]))
        assert len(workers) == 2 and workers <= pids, (workers, pids)

        tmux.keys("C-c")
        wait_for(lambda: "RUN-EXIT=" in tmux.pane(), 180, "the launcher's exit", interval=0.3)
        screen = tmux.pane()
        assert f"RUN-EXIT={EXIT_PREEMPTED}" in screen, screen
        # The launch's own files joined its workers' beside the snapshots.
        assert not ev.exists() and not (tmp_path / "elastictrain-run").exists()
        ev = ckpt / "events"
        assert "Ctrl-C (SIGINT) to the launcher: asking the workers for a final snapshot" \
            in screen, screen
        saved = {e["snapshot_step"] for e in events(ev, "preempt.saved")}
        assert len(saved) == 1, saved
        step = saved.pop()
        assert f"final snapshot of step {step} committed" in screen, screen
        assert (ckpt / layout.step_dir(step) / layout.MANIFEST).exists()
        assert "elastictrain run: exit 75: stopped after a final snapshot" in screen, screen
        assert f"final snapshot:  step {step}" in screen, screen
        # The job's own output is in the files named; rank 0's print is shown above the
        # area, prefixed by its rank (rank 1's is not, by default), and no event as JSON.
        assert '"event"' not in screen, screen
        assert "[rank 0] rank 0: training from step 0" in screen, screen
        assert "rank 1: training from step" not in screen, screen
        assert any("rank 0: training from step 0" in p.read_text()
                   for p in ev.rglob("torchelastic/*/*/attempt_0/0/stdout.log"))
        wait_for(lambda: not any(pid_alive(p) for p in pids), 30,
                 f"no process of the job left ({sorted(pids)})")
    finally:
        for pid in pids:  # whatever the Ctrl-C handling left, stopped by pid
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_run_off_a_terminal_prints_no_view(tmp_path: Path) -> None:
    example = REPO / "examples" / "ddp_resumable.py"
    result = run_cli(["run", "--nproc-per-node=2", str(example), str(tmp_path / "ckpt")],
                     tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout + result.stderr
    for view_text in ("worker logs", "Ctrl-C stops the job", "elastictrain run: exit"):
        assert view_text not in out
    # As before: the workers write to the launcher's (inherited) stderr, nothing to files.
    assert "worker.start" in result.stderr, result.stderr[-4000:]
    assert not (tmp_path / "elastictrain-run").exists()  # gathered beside the snapshots
    run_dir = tmp_path / "ckpt" / "events"
    assert list(run_dir.rglob("agent-*.jsonl"))
    assert not list(run_dir.rglob("launcher-*.log")) and not list(run_dir.rglob("torchelastic"))
