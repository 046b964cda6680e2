"""Goodput accounting from synthetic event files (the e2e demo test covers real ones)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastictrain.runlog.goodput import compute_goodput


def write(path: Path, events: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def test_accounts_restart_lost_work_and_blocking(tmp_path: Path) -> None:
    # Attempt 0: starts at t=0, resumes fresh at t=2, 0.1 s/step, snapshot at step 10
    # (staging blocks 0.5 s), killed around step 14. Attempt 1 resumes from 10 at t=6,
    # loses 4 steps, finishes step 30 at t=8.
    write(tmp_path / "attempt000-rank0.jsonl", [
        {"event": "worker.start", "ts": 0.0, "step": 0},
        {"event": "resume", "ts": 2.0, "step": 0, "from_step": None, "lost_steps": 0},
        {"event": "snapshot.staged", "ts": 3.0, "step": 10, "duration_s": 0.5},
    ])
    write(tmp_path / "attempt001-rank0.jsonl", [
        {"event": "worker.start", "ts": 4.0, "step": 0},
        {"event": "resume", "ts": 6.0, "step": 10, "from_step": 10, "lost_steps": 4},
        {"event": "run.finished", "ts": 8.0, "step": 30},
    ])
    report = compute_goodput(tmp_path)
    assert report.attempts == 2 and report.final_step == 30 and report.steps_lost == 4
    assert report.step_time_s == pytest.approx(0.1)
    assert report.productive_s == pytest.approx(3.0)
    assert report.lost_work_s == pytest.approx(0.4)
    assert report.snapshot_blocking_s == pytest.approx(0.5)
    assert report.restart_s == pytest.approx(8.0 - 3.0 - 0.4 - 0.5)
    assert report.pending_s == 0.0  # restarts inside one launch are not pending
    assert report.goodput == pytest.approx(3.0 / 8.0)


def test_missing_events_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        compute_goodput(tmp_path)


def test_relaunches_of_one_run_are_attempts_and_their_gap_is_pending(tmp_path: Path) -> None:
    # Two launches (a Slurm requeue): the first trains 0→50 at 0.1 s/step and is
    # preempted at t=7 with a final snapshot; the job waits 120 s pending; the second
    # resumes from 50 at t=129 and finishes step 100 at t=134.
    write(tmp_path / "attempt000-20261123T100000Z-aaaa-rank0.jsonl", [
        {"event": "worker.start", "ts": 0.0, "step": 0, "launch_id": "20261123T100000Z-aaaa"},
        {"event": "resume", "ts": 2.0, "step": 0, "from_step": None, "lost_steps": 0,
         "launch_id": "20261123T100000Z-aaaa"},
        {"event": "snapshot.committed", "ts": 7.0, "step": 50,
         "launch_id": "20261123T100000Z-aaaa"},
    ])
    write(tmp_path / "attempt000-20261123T100207Z-bbbb-rank0.jsonl", [
        {"event": "worker.start", "ts": 127.0, "step": 0, "launch_id": "20261123T100207Z-bbbb"},
        {"event": "resume", "ts": 129.0, "step": 50, "from_step": 50, "lost_steps": 0,
         "launch_id": "20261123T100207Z-bbbb"},
        {"event": "run.finished", "ts": 134.0, "step": 100,
         "launch_id": "20261123T100207Z-bbbb"},
    ])
    report = compute_goodput(tmp_path)
    assert report.attempts == 2 and report.final_step == 100 and report.steps_lost == 0
    assert report.step_time_s == pytest.approx(0.1)
    assert report.productive_s == pytest.approx(10.0)
    assert report.pending_s == pytest.approx(120.0)
    assert report.restart_s == pytest.approx(134.0 - 10.0 - 120.0)
    assert report.goodput == pytest.approx(10.0 / 134.0)


def test_a_degraded_memory_tier_is_noted_with_how_long_it_was_off(tmp_path: Path) -> None:
    # Off from t=3 (two things, one back at t=4, the other at t=5), then off again from
    # t=7 to the attempt's end at t=8: 3 s in all.
    write(tmp_path / "attempt000-rank0.jsonl", [
        {"event": "resume", "ts": 2.0, "step": 0, "from_step": None, "lost_steps": 0},
        {"event": "snapshot.memory_degraded", "ts": 3.0, "what": "memory snapshot"},
        {"event": "snapshot.memory_degraded", "ts": 3.5, "what": "rescue boundary record"},
        {"event": "snapshot.memory_recovered", "ts": 4.0, "what": "memory snapshot"},
        {"event": "snapshot.memory_recovered", "ts": 5.0, "what": "rescue boundary record"},
        {"event": "snapshot.memory_degraded", "ts": 7.0, "what": "memory snapshot"},
        {"event": "run.finished", "ts": 8.0, "step": 30},
    ])
    report = compute_goodput(tmp_path)
    assert report.notes == ("the node-memory tier was off for 3.0s (memory snapshot, rescue "
                            "boundary record): a failure then restarted from durable "
                            "snapshots",)
    assert list(report.to_dict()["notes"]) == list(report.notes)


def test_no_note_without_a_degraded_memory_tier(tmp_path: Path) -> None:
    write(tmp_path / "attempt000-rank0.jsonl", [
        {"event": "resume", "ts": 2.0, "step": 0, "from_step": None, "lost_steps": 0},
        {"event": "run.finished", "ts": 8.0, "step": 30},
    ])
    report = compute_goodput(tmp_path)
    assert report.notes == ()
