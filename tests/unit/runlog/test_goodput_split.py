"""The per-cause split of a run's wall time on a synthetic event log whose every second
is known: a kill, a preemption, a relaunch that hung, and a finish; and its plot."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from elastictrain.core.errors import ConfigError
from elastictrain.runlog.accounting.plot import plot_split
from elastictrain.runlog.accounting.split import CAUSES, format_split, split_run


def _write(path: Path, *events: dict[str, Any]) -> None:
    with path.open("a") as f:
        for event in events:
            f.write(json.dumps(event) + "\n")


def _ev(name: str, ts: float, step: int | None = 0, **fields: Any) -> dict[str, Any]:
    return {"event": name, "ts": ts, "step": step, **fields}


def write_synthetic_run(tmp_path: Path) -> Path:
    """The synthetic event log whose every second is known (the module's docstring)."""
    d = tmp_path / "events"
    d.mkdir()
    _write(d / "agent-host-1.jsonl", _ev("agent.start", 0.0, None),
           _ev("agent.worker_failed", 6.6, None, signal="SIGKILL", exit_code=-9),
           _ev("agent.finished", 37.0, None))
    # Attempt 0: 10 steps at 0.25 s, snapshot of step 10 blocks 0.5 s, killed at step
    # 14 (silently: the next attempt reports 4 lost steps) -> ends at 6.5 s.
    _write(d / "attempt000-rank0.jsonl", _ev("worker.start", 1.0),
           _ev("resume", 3.0, from_step=None, lost_steps=0),
           _ev("snapshot.staged", 5.5, 10, snapshot_step=10, duration_s=0.5),
           _ev("snapshot.committed", 5.5, 10, snapshot_step=10))
    # Attempt 1: restore 0.5 s; a save waits 1 s for the one in flight (back-pressure,
    # inside the staged duration: counted once); preempted with a 1 s drain at step 25.
    _write(d / "attempt001-rank0.jsonl", _ev("worker.start", 8.0),
           _ev("snapshot.loaded", 9.5, 10, duration_s=0.5),
           _ev("resume", 10.0, 10, from_step=10, lost_steps=4),
           _ev("snapshot.backpressure", 12.0, 20, wait_s=1.0),
           _ev("snapshot.staged", 12.5, 20, snapshot_step=20, duration_s=1.5),
           _ev("preempt.notice", 14.0, 24),
           _ev("preempt.saved", 15.0, 25, duration_s=1.0))
    # A relaunch appends to the file of restart 0: it hangs 4 s after 5 steps (lost).
    _write(d / "attempt000-rank0.jsonl", _ev("worker.start", 20.0),
           _ev("snapshot.loaded", 21.0, 25, duration_s=0.5),
           _ev("resume", 21.0, 25, from_step=25, lost_steps=0),
           _ev("watchdog.fired", 30.0, 30, idle_s=4.0))
    _write(d / "attempt002-rank0.jsonl", _ev("worker.start", 31.0),
           _ev("resume", 33.0, 25, from_step=25, lost_steps=5),
           _ev("run.finished", 36.0, 35))
    return d


def test_training_on_a_suspect_restore_is_its_own_cause_and_the_fallback_loses_work(
        tmp_path: Path) -> None:
    """Attempt 0 trains 0-24 (0.25 s a step, snapshots 10 and 20) and is killed; attempt
    1 restores 20, trains 4 steps and finds the restore suspect; attempt 2 falls back to
    10 and finishes at 30: attempt 0's steps after 10 are lost work, attempt 1's window
    is ``suspect``."""
    d = tmp_path / "events"
    d.mkdir()
    _write(d / "agent-host-1.jsonl", _ev("agent.start", 0.0, None),
           _ev("agent.worker_failed", 8.2, None, signal="SIGKILL", exit_code=-9),
           _ev("agent.worker_failed", 11.5, None, exit_code=1),
           _ev("agent.finished", 18.5, None))
    _write(d / "attempt000-rank0.jsonl", _ev("worker.start", 1.0),
           _ev("resume", 2.0, from_step=None, lost_steps=0),
           _ev("snapshot.staged", 4.5, 10, snapshot_step=10, duration_s=0.0),
           _ev("snapshot.committed", 4.5, 10, snapshot_step=10),
           _ev("snapshot.staged", 7.0, 20, snapshot_step=20, duration_s=0.0),
           _ev("snapshot.committed", 7.0, 20, snapshot_step=20))
    _write(d / "attempt001-rank0.jsonl", _ev("worker.start", 9.0),
           _ev("snapshot.loaded", 10.0, 20, duration_s=0.5),
           _ev("resume", 10.0, 20, from_step=20, lost_steps=4),
           _ev("snapshot.suspect", 11.0, 24, snapshot_step=20))
    _write(d / "attempt002-rank0.jsonl", _ev("worker.start", 12.0),
           _ev("snapshot.loaded", 13.0, 10, duration_s=0.5),
           _ev("resume", 13.0, 10, from_step=10, lost_steps=14),
           _ev("run.finished", 18.0, 30))
    split = split_run(d)
    assert split.seconds == pytest.approx({
        "productive": 2.5 + 5.0, "lost_work": 3.5, "suspect": 1.0, "restore": 1.0,
        "restart": 2.0 + 1.0 + 0.5 + 1.0 + 0.5 + 0.5, "snapshot_blocking": 0.0,
        "preempt_drain": 0.0, "hang": 0.0, "between_launches": 0.0})
    got = [(a.from_step, a.to_step, a.lost_steps, a.ended_by) for a in split.attempts]
    assert got == [(None, 24, 14, "SIGKILL"), (20, 24, 4, "suspect snapshot"),
                   (10, 30, 0, "finished")]
    assert "suspect restore" in format_split(split)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_synthetic_run(tmp_path)


def test_every_second_lands_in_one_cause(run_dir: Path) -> None:
    split = split_run(run_dir)
    assert split.wall_s == pytest.approx(37.0)
    expected = {"productive": 2.0 + 2.5 + 0.0 + 3.0, "lost_work": 1.0 + 5.0,
                "snapshot_blocking": 0.5 + 1.5, "restore": 1.0, "preempt_drain": 1.0,
                "hang": 4.0, "restart": 3.0 + 2.5 + 0.5 + 5.5 + 3.0 + 1.0,
                "between_launches": 0.0,  # events of no launch id: one launch
                "suspect": 0.0}
    assert split.seconds == pytest.approx(expected)
    assert sum(split.seconds.values()) == pytest.approx(split.wall_s)
    assert split.blocking_by_tier == pytest.approx({"durable": 2.0})
    got = [(a.from_step, a.to_step, a.lost_steps, a.ended_by) for a in split.attempts]
    assert got == [(None, 14, 4, "SIGKILL"), (10, 25, 0, "preempted"),
                   (25, 30, 5, "hang (watchdog)"), (25, 35, 0, "finished")]
    # Lost work is the end of the killed attempt: after the snapshot it resumed from.
    lost = [s for s in split.attempts[0].spans if s.cause == "lost_work"]
    assert [(s.start, s.end) for s in lost] == [(5.5, 6.5)]
    assert split.attempts[0].commits == [(5.5, 10, "durable")]


def test_report_and_json_close_to_100_percent(run_dir: Path) -> None:
    split = split_run(run_dir)
    data = split.to_dict()
    assert set(data["seconds"]) == set(CAUSES)
    assert sum(data["fractions"].values()) == pytest.approx(1.0, abs=1e-3)
    text = format_split(split)
    assert text.startswith("goodput 20.3% of 37.0s wall, 4 attempts, final step 35, "
                           "9 steps lost")
    assert "hang (watchdog)" in text and "#2 hang (watchdog)" in text


def test_missing_events_is_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="fix: point at a run's events directory"):
        split_run(tmp_path)


def test_plot_writes_a_png(run_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = plot_split(split_run(run_dir), tmp_path / "split.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(run_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'elastictrain\[plot\]'"):
        plot_split(split_run(run_dir), tmp_path / "split.png")
    assert not (tmp_path / "split.png").exists()


def test_work_lost_before_an_attempt_that_died_in_start_up_is_counted(tmp_path: Path) -> None:
    """bench_goodput's seed 0: a second kill 2.5 s after the first hits the restarted
    worker before its resume; the first attempt's steps after its last snapshot are
    still lost work (before: counted productive, because the next attempt had no
    resume to say so)."""
    d = tmp_path / "events"
    d.mkdir()
    # Attempt 0: steps 1-20 at 0.25 s from 2.0 s, snapshot of step 10 at 4.5 s, killed
    # at step 20 (7.0 s) with no event after the commit: how far it got is known only
    # from attempt 2, which resumes from 10 and reports 10 lost steps (the progress file
    # still holds step 20). Attempt 1 is killed in start-up.
    _write(d / "attempt000-rank0.jsonl", _ev("worker.start", 0.0),
           _ev("resume", 2.0, from_step=None, lost_steps=0),
           _ev("snapshot.staged", 4.5, 10, snapshot_step=10, duration_s=0.0),
           _ev("snapshot.committed", 4.5, 10, snapshot_step=10))
    _write(d / "attempt001-rank0.jsonl", _ev("worker.start", 8.0))
    _write(d / "attempt002-rank0.jsonl", _ev("worker.start", 11.0),
           _ev("resume", 13.0, 10, from_step=10, lost_steps=10),
           _ev("run.finished", 15.5, 20))
    split = split_run(d)
    got = [(a.from_step, a.to_step, a.lost_steps) for a in split.attempts]
    assert got == [(None, 20, 10), (None, 0, 0), (10, 20, 0)]
    assert split.seconds["lost_work"] == pytest.approx(2.5)  # steps 11-20 of attempt 0
    assert split.seconds["productive"] == pytest.approx(2.5 + 2.5)
    assert sum(split.seconds.values()) == pytest.approx(split.wall_s)
