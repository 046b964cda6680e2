"""The README's example as a user first runs it, in a real terminal (tmux): ``elastictrain
run`` with its live view, Ctrl-C while it trains, then the same command again. Every file
of both launches ends up under ``./ckpt`` (nothing in ``./elastictrain-run``), the
summary names them there, and ``status`` and ``goodput`` on ``./ckpt`` report one run of
two launches: the second resumed from the first's final snapshot, no step lost, the time
between the launches counted as such.

The script is unmodified; a ``sitecustomize`` on the workers' ``PYTHONPATH``
(tests/processes/e2e/user_script_hook) holds every rank after step 12 until the notice
that Ctrl-C sends, so the key is pressed while the job trains."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, events, run_cli, wait_for
from tests.processes.view.terminal import Tmux

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "examples" / "ddp_resumable.py"
HOOK = REPO / "tests" / "processes" / "e2e" / "user_script_hook"
FINAL_STEP = 48


def _run(tmp_path: Path, tmux: Tmux, marker: str, park: str = "") -> None:
    # pytest exports COLUMNS=80 and LINES=24, which rich would take over the pane's size.
    env = (f"-u COLUMNS -u LINES PYTHONPATH={HOOK}{os.pathsep}{REPO} TMPDIR={tmp_path} "
           f"ET_TEST_PARK_DIR={tmp_path} {park}")
    tmux.start(f"cd {tmp_path} && env {env} {sys.executable} -m elastictrain.cli run "
               f"--nproc-per-node 2 {SCRIPT} ./ckpt; echo {marker}=$?; sleep 600")


def _cli_json(tmp_path: Path, *args: str) -> dict[str, object]:
    result = run_cli([*args, "--json"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(json.loads(result.stdout))


def test_ctrl_c_then_the_same_command_is_one_run_kept_in_ckpt(tmp_path: Path) -> None:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    first, second = Tmux(), Tmux()
    try:
        _run(tmp_path, first, "FIRST-EXIT",
             park="ET_TEST_PARK_AT=12 ET_TEST_PARK_UNTIL_NOTICE=1")
        parked = [tmp_path / f"parked-rank{r}" for r in (0, 1)]
        wait_for(lambda: all(p.exists() for p in parked), 240, "both ranks held at step 12")
        first.keys("C-c")
        wait_for(lambda: "FIRST-EXIT=" in first.pane(), 120, "the first launch's exit",
                 interval=0.3)
        screen = first.pane()
        assert "FIRST-EXIT=75" in screen, screen
        _run(tmp_path, second, "SECOND-EXIT")
        wait_for(lambda: "SECOND-EXIT=" in second.pane(), 240, "the second launch's exit",
                 interval=0.3)
        again = second.pane()
    finally:
        for server in (first, second):
            server.kill()
    assert "SECOND-EXIT=0" in again, again

    assert sorted(os.listdir(tmp_path / "ckpt")) == ["RUN", "events", "snapshots"]
    assert not (tmp_path / "elastictrain-run").exists()
    (run_dir,) = (tmp_path / "ckpt" / "events").iterdir()
    # Both launches' agents, launcher logs and worker output are there, no link left.
    agents = sorted(run_dir.glob("agent-*.jsonl"))
    launches = sorted({p.name.split("-")[1] + "-" + p.name.split("-")[2] for p in agents})
    assert len(launches) == 2, agents
    for launch in launches:
        assert (run_dir / f"launcher-{launch}.log").is_file()
        assert list((run_dir / "torchelastic" / launch).rglob("stdout.log"))
    assert not [p for p in run_dir.iterdir() if p.is_symlink()]
    # Each summary names where its files are now.
    for screen_text in (screen, again):
        summary = re.sub(r"\s+", "", screen_text[screen_text.index("elastictrain run: exit"):])
        assert f"events:{run_dir}".replace(" ", "") in summary, screen_text
    final = [e for e in events(run_dir, "preempt.saved") if e["rank"] == 0]
    resumed = [e["from_step"] or 0 for e in events(run_dir, "resume") if e["rank"] == 0]
    assert len(final) == 1 and resumed == [0, final[0]["step"]], resumed

    status = _cli_json(tmp_path, "status", "ckpt")
    assert (status["finished"], status["step"], status["launches"]) == \
        ("finished", FINAL_STEP, 2), status
    assert status["lost_steps"] == 0 and status["runs"] == [run_dir.name], status
    goodput = _cli_json(tmp_path, "goodput", "ckpt")
    assert (goodput["launches"], goodput["final_step"], goodput["steps_lost"]) == \
        (2, FINAL_STEP, 0), goodput
    assert goodput["between_launches_s"] > 0, goodput
    assert [a["ended_by"] for a in goodput["split"]["attempts"]] == ["preempted", "finished"]
