"""A run that spans launches (a Ctrl-C, then the same command again): the time no launch
was up is ``between_launches``, not restart time, and the report says how many launches
the run spans (the status model across launches: tests/unit/view/test_model_launches.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastictrain.runlog.accounting.split import format_split, split_run
from tests.unit.runlog.test_goodput_split import _ev, _write

A, B = "20261129T120000Z-aaaa", "20261129T120100Z-bbbb"


def _two_launches(tmp_path: Path) -> Path:
    d = tmp_path / "events"
    d.mkdir()
    _write(d / f"agent-{A}-h-1.jsonl", _ev("agent.start", 0.0, None, launch_id=A),
           _ev("agent.finished", 12.0, None, launch_id=A, exit_code=75))
    _write(d / f"attempt000-{A}-rank0.jsonl", _ev("worker.start", 1.0, launch_id=A),
           _ev("resume", 2.0, 0, from_step=None, lost_steps=0, launch_id=A),
           _ev("preempt.notice", 10.0, 8, launch_id=A),
           _ev("preempt.saved", 11.0, 8, duration_s=1.0, launch_id=A))
    # 20 s with nothing up, then the same command again.
    _write(d / f"agent-{B}-h-2.jsonl", _ev("agent.start", 32.0, None, launch_id=B),
           _ev("agent.finished", 45.0, None, launch_id=B, exit_code=0))
    _write(d / f"attempt000-{B}-rank0.jsonl", _ev("worker.start", 33.0, launch_id=B),
           _ev("resume", 34.0, 8, from_step=8, lost_steps=0, launch_id=B),
           _ev("run.finished", 44.0, 18, launch_id=B))
    return d


def test_the_time_between_launches_is_its_own_cause(tmp_path: Path) -> None:
    split = split_run(_two_launches(tmp_path))
    assert split.seconds["between_launches"] == pytest.approx(20.0)
    # Each launch: 2 s from its agent's start to the resume, 1 s from the last event on.
    assert split.seconds["restart"] == pytest.approx(2 * (2.0 + 1.0))
    assert sum(split.seconds.values()) == pytest.approx(split.wall_s)
    assert [a.launch for a in split.attempts] == [A, B]
    assert format_split(split).startswith("goodput ") and \
        "2 launches, 2 attempts" in format_split(split).splitlines()[0]
    assert "between launches" in format_split(split)


def test_one_launch_has_no_time_between_launches(tmp_path: Path) -> None:
    d = _two_launches(tmp_path)
    for path in d.glob(f"*{B}*"):
        path.unlink()
    split = split_run(d)
    assert split.seconds["between_launches"] == 0.0
    assert "launches" not in format_split(split).splitlines()[0]
