"""The parts of `elastictrain run`'s live view that need no job: its flag, where the
output goes (the user's torchrun options win), the launch filter, the Ctrl-C and
final-snapshot lines, the summary and the exit code's meaning."""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from elastictrain.launcher.exits import exit_meaning
from elastictrain.launcher.run_args import take_no_view
from elastictrain.storage import open_store
from elastictrain.view.live import LiveView, render
from elastictrain.view.model import RunState
from elastictrain.view.run import RunOutput, summary, worker_log_args


def test_no_view_is_taken_from_the_launcher_options_only() -> None:
    assert take_no_view(["--no-view", "--nproc-per-node=2", "train.py", "--no-view"]) == (
        True, ["--nproc-per-node=2", "train.py", "--no-view"])  # the script's own stays
    assert take_no_view(["-m", "pkg.train", "--no-view"]) == (False,
                                                              ["-m", "pkg.train", "--no-view"])


@pytest.mark.parametrize(("given", "log_dir", "added", "logs"), [
    (set(), None, ["--redirects=3", "--log-dir=EV/torchelastic/L1"], "EV/torchelastic/L1"),
    ({"redirects"}, None, ["--log-dir=EV/torchelastic/L1"], "EV/torchelastic/L1"),
    ({"log_dir"}, "/mine", ["--redirects=3"], "/mine"),
    ({"redirects", "log_dir"}, "/mine", [], "/mine"),
    ({"tee"}, None, ["--log-dir=EV/torchelastic/L1"], "EV/torchelastic/L1"),
])
def test_workers_output_goes_to_files_unless_the_user_chose(
        given: set[str], log_dir: str | None, added: list[str], logs: str) -> None:
    assert worker_log_args(given, log_dir, Path("EV"), "L1") == (added, logs)


def event(**fields: Any) -> str:
    return json.dumps({"run_id": "r", "world_size": 2, **fields}) + "\n"


def test_the_view_shows_only_its_own_launch_and_where_the_output_is(tmp_path: Path) -> None:
    # A requeued run reuses its events dir: the older launch's files are still there.
    (tmp_path / "attempt002-old-rank0.jsonl").write_text(
        event(event="resume", rank=0, restart_count=2, step=90, from_step=80, lost_steps=4,
              launch_id="old", ts=1.0))
    (tmp_path / "attempt000-new-rank0.jsonl").write_text(
        event(event="resume", rank=0, restart_count=0, step=100, from_step=100, lost_steps=0,
              launch_id="new", ts=2.0)
        + event(event="train.progress", rank=0, restart_count=0, step=130, launch_id="new",
                ts=3.0))
    screen = io.StringIO()
    view = LiveView(open_store(str(tmp_path)), "", "elastictrain run r",
                    console=Console(file=screen, width=120),
                    rows=[("worker logs", "EV/torchelastic/L1")], launch="new")
    view.start()
    view.stop()
    assert view.state.attempt == 0 and view.state.step == 130
    assert [line.text for line in view.state.lines] == [
        "attempt 0: resumed from step 100 (lost 0 steps)"]
    assert "worker logs  EV/torchelastic/L1" in screen.getvalue()


def test_without_a_total_the_view_shows_step_and_rate() -> None:
    state = RunState()
    for ts, step in ((1.0, 10), (3.0, 30)):
        state.apply({"event": "train.progress", "rank": 0, "restart_count": 0, "step": step,
                     "ts": ts})
    screen = io.StringIO()
    Console(file=screen, width=100).print(render(state, "elastictrain run r", now=4.0))
    assert "step 30  10.0 steps/s" in screen.getvalue()
    assert "━" not in screen.getvalue()  # no progress bar without a total


def test_ctrl_c_and_the_final_snapshot_are_one_line_each() -> None:
    state = RunState()
    state.apply({"event": "agent.signal_forwarded", "role": "agent", "signal": "SIGTERM",
                 "received": "SIGINT", "grace_s": 90, "ts": 1.0})
    for rank in (0, 1):
        state.apply({"event": "preempt.saved", "rank": rank, "restart_count": 0, "step": 42,
                     "snapshot_step": 42, "duration_s": 0.5, "ts": 2.0 + rank})
    state.apply({"event": "agent.signal_forwarded", "role": "agent", "signal": "SIGHUP",
                 "received": "SIGHUP", "grace_s": 90, "ts": 4.0})
    assert [line.text for line in state.lines] == [
        "Ctrl-C (SIGINT) to the launcher: asking the workers for a final snapshot "
        "(SIGTERM, up to 90 s)",
        "final snapshot of step 42 committed 0.5 s after the notice",
        "SIGHUP to the launcher: workers stopped with SIGHUP"]
    assert state.final_snapshot == 42


def test_summary_says_the_outcome_and_where_things_are(tmp_path: Path) -> None:
    state = RunState()
    state.apply({"event": "resume", "rank": 0, "restart_count": 1, "step": 20,
                 "from_step": 20, "lost_steps": 3, "world_size": 2, "ts": 1.0})
    state.apply({"event": "preempt.saved", "rank": 0, "restart_count": 1, "step": 25,
                 "snapshot_step": 25, "ts": 2.0})
    output = RunOutput(tmp_path, str(tmp_path / "torchelastic"), tmp_path / "launcher-x.log")
    text = summary(state, 75, exit_meaning(75), output)
    assert text.splitlines()[0] == ("elastictrain run: exit 75: stopped after a final "
                                    "snapshot; the same command resumes from it")
    assert "attempts:        2 (1 restart)" in text and "lost steps:      3" in text
    assert "final snapshot:  step 25" in text
    assert f"worker output:   {tmp_path / 'torchelastic'}" in text
    assert f"launcher log:    {tmp_path / 'launcher-x.log'}" in text


@pytest.mark.parametrize(("code", "says"), [
    (0, "finished"), (1, "restarts are used up"), (76, "did not commit"),
    (78, "do not retry"), (130, "stopped by SIGINT; the same command resumes"), (3, "failed")])
def test_every_exit_code_has_a_meaning(code: int, says: str) -> None:
    assert says in exit_meaning(code)




def test_after_a_restart_the_rate_is_the_new_attempts_from_its_first_step() -> None:
    """A restarted attempt's worker.start (step 0) and resume (step 150) are no progress:
    the rate is what the attempt trains after its first step, 14 steps/s here."""
    state = RunState()
    for ts, step in ((1.0, 10), (11.0, 150)):  # attempt 0: 14 steps/s
        state.apply({"event": "train.progress", "rank": 0, "restart_count": 0, "step": step,
                     "ts": ts})
    state.apply({"event": "agent.attempt_started", "role": "agent", "restart_count": 1,
                 "world_size": 2, "ts": 20.0})
    state.apply({"event": "worker.start", "rank": 0, "restart_count": 1, "step": 0,
                 "ts": 30.0})
    state.apply({"event": "resume", "rank": 0, "restart_count": 1, "step": 150,
                 "from_step": 150, "ts": 31.0})
    for ts, step in ((32.0, 151), (34.0, 179)):  # the first step, then 14 steps/s
        state.apply({"event": "train.progress", "rank": 0, "restart_count": 1, "step": step,
                     "ts": ts})
    assert state.step == 179
    assert state.rate == 14.0


def test_with_a_total_the_view_shows_the_time_left_at_the_current_rate() -> None:
    state = RunState(total_steps=300)
    for ts, step in ((1.0, 10), (3.0, 30)):  # 10 steps/s: 270 steps left, 27 s
        state.apply({"event": "train.progress", "rank": 0, "restart_count": 0, "step": step,
                     "ts": ts})
    screen = io.StringIO()
    Console(file=screen, width=120).print(render(state, "elastictrain demo", now=4.0))
    assert "step 30/300  10.0 steps/s  ETA 27s" in screen.getvalue()
