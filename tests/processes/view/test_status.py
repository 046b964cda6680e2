"""``elastictrain status`` on real demo runs: a finished killed run from its storage, and
``--follow`` on a run that is still going."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import child_env, kill_session, run_cli, started, wait_for

pytestmark = pytest.mark.distributed


def test_status_json_of_a_finished_killed_run(tmp_path: Path,
                                              one_kill_demo: dict[str, Any]) -> None:
    out, storage = one_kill_demo, one_kill_demo["storage"]
    result = run_cli(["status", str(storage), "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["run_id"] == Path(out["events_dir"]).name
    assert status["attempts"] == 2 and status["world_size"] == 2
    assert status["finished"] == "finished" and status["step"] == 60
    assert status["newest_snapshot"]["step"] == 60
    assert status["committed_snapshots"] == sorted(status["committed_snapshots"])
    assert status["last_snapshot"]["step"] == 60  # the same, as the events saw it
    failures = [f["text"] for f in status["failures"]]
    assert "worker rank 1 killed by SIGKILL" in failures
    texts = [line["text"] for line in status["lines"]]
    assert "attempt 1: resumed from step 30 (lost 4 steps)" in texts
    text = run_cli(["status", str(storage)], tmp_path)  # the same for humans, off a terminal
    assert text.returncode == 0 and "attempt 1" in text.stdout
    assert "resumed from step 30 (lost 4 steps)" in text.stdout


def test_status_of_a_place_without_a_run_says_so(tmp_path: Path) -> None:
    (tmp_path / "nothing").mkdir()
    result = run_cli(["status", str(tmp_path / "nothing")], tmp_path)
    assert result.returncode == 2  # bad input, like every command's
    assert result.stderr.strip().count("\n") == 0  # one line: path, problem, fix
    assert "no events and no snapshots" in result.stderr and "fix:" in result.stderr


def test_status_follow_shows_progress_until_the_run_ends(tmp_path: Path) -> None:
    storage = tmp_path / "s"
    demo = [sys.executable, "-m", "elastictrain.cli", "demo", "--json", f"--storage={storage}",
            "--steps=100", "--snapshot-every=20", "--kill-at=50"]
    with started(demo, tmp_path, "demo.log") as job:
        wait_for(lambda: any((storage / "events").rglob("attempt000-*rank0.jsonl")), 120,
                 "the demo's first event file")
        follow = subprocess.Popen(
            [sys.executable, "-m", "elastictrain.cli", "status", str(storage), "--follow",
             "--timeout=300"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=child_env(tmp_path), start_new_session=True)
        try:
            out, err = follow.communicate(timeout=330)
        finally:
            kill_session(follow)
        assert follow.returncode == 0, err  # it saw the end, not the timeout
        assert job.wait(timeout=60) == 0
    lines = out.splitlines()
    steps = [int(s.split()[1]) for s in lines if s.startswith("step ")]
    assert len(steps) >= 3 and steps[-1] == 100  # progress as it went, up to the end
    assert any("worker rank 1 killed by SIGKILL" in s for s in lines)
    assert any("resumed from step 40" in s for s in lines)
    assert "launcher exited 0 (finished)" in lines[-2] + lines[-1]
