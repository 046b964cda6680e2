"""A node trial on a user's script reads its steps from train.progress events (step
marks) in place of the demo's sample records: the marks pass a good trial and fail the
bad ones the node checks exist for, on made-up events (the real job:
test_chaos_nodes.py)."""

from __future__ import annotations

from typing import Any

import pytest

from elastictrain.chaos.nodechecks import NODE_KEY, Expectation, Loss, NodeLife, check_node_resumes
from elastictrain.chaos.noderun import expectation
from elastictrain.chaos.runner import ChaosOptions
from elastictrain.chaos.stepmarks import (
    final_world_sizes_of,
    step_marks,
    unmarked_steps,
    widest_gap,
)
from elastictrain.core.errors import ElasticTrainError

LOCAL = Expectation(memory_every=3, durable_every=10)
A, B = NodeLife("a.0", 0, None), NodeLife("b.0", 0, 20)


def ev(name: str, ts: float, node: str, rank: int = 0, **fields: Any) -> dict[str, Any]:
    return {"event": name, "ts": ts, "rank": rank, NODE_KEY: node, **fields}


def progress(upto: int, ts: float, world_size: int = 2, first: int = 1) -> list[dict[str, Any]]:
    """Both ranks' train.progress of steps first..upto (rank 1 on node b)."""
    return [ev("train.progress", ts + s / 100 + rank / 1000, ("a.0", "b.0")[rank], rank,
               step=s, world_size=world_size, loss=None)
            for s in range(first, upto + 1) for rank in range(world_size)]


def commit(ts: float, node: str, step: int, rank: int, tier: str) -> dict[str, Any]:
    return ev("snapshot.committed", ts, node, rank, snapshot_step=step, tier=tier)


# Two nodes train to step 14 (durable 10, memory 12 on both); node b is lost at 20 and
# node a resumes alone from its memory copy of step 12.
BEFORE = [ev("resume", 1, "a.0", from_step=None),
          commit(5, "a.0", 10, 0, "durable"), commit(6, "a.0", 12, 0, "memory"),
          commit(6.1, "b.0", 12, 1, "memory")]
RESUME = ev("resume", 22, "a.0", from_step=12, tier="memory", world_size=1)


def test_marks_are_the_trained_steps_of_every_rank_in_time_order() -> None:
    events = [*BEFORE, *progress(3, 2), ev("train.progress", 9, "a.0", step=None)]
    marks = step_marks(sorted(events, key=lambda e: -e["ts"]))
    assert [(m["step"], m["rank"]) for m in marks] == [(s, r) for s in (1, 2, 3) for r in (0, 1)]
    assert [m["ts"] for m in marks] == sorted(m["ts"] for m in marks)


def test_lost_steps_from_marks_pass_within_the_interval_and_fail_beyond() -> None:
    ok = step_marks([*BEFORE, *progress(15, 2), RESUME])
    assert check_node_resumes([*BEFORE, RESUME], [A, B], ok, LOCAL, Loss(20, False)) is None
    # The lost node's marks count: its rank reached 16, 4 steps past the copy of 12.
    late = step_marks([*BEFORE, *progress(15, 2), ev("train.progress", 19, "b.0", 1, step=16,
                                                       world_size=2), RESUME])
    assert "lost 4 steps (from step 12; allowed 3)" in str(
        check_node_resumes([*BEFORE, RESUME], [A, B], late, LOCAL, Loss(20, False)))
    # Resuming from durable 10 although both nodes held memory step 12 fails too.
    durable = ev("resume", 22, "a.0", from_step=10, tier="durable", world_size=1)
    assert "although step 12 was complete" in str(
        check_node_resumes([*BEFORE, durable], [A, B], ok, LOCAL, Loss(20, False)))


def test_the_latest_execution_of_each_step_gives_the_final_world_sizes() -> None:
    full = progress(20, 2)
    assert final_world_sizes_of(step_marks(full)) == {2}
    # Resumed at world size 1 from step 12: steps 13..20 redone alone, 1..12 kept.
    shrunk = [*full, *(ev("train.progress", 30 + s, "a.0", step=s, world_size=1)
                       for s in range(13, 41))]
    assert final_world_sizes_of(step_marks(shrunk)) == {1, 2}
    # Resumed from step 0 at world size 1: nothing of the full-size run counts.
    fresh = [*full, *(ev("train.progress", 30 + s, "a.0", step=s, world_size=1)
                      for s in range(1, 41))]
    assert final_world_sizes_of(step_marks(fresh)) == {1}


def test_a_step_without_a_mark_is_found() -> None:
    assert unmarked_steps(step_marks(progress(5, 2))) == []
    assert unmarked_steps(step_marks([*progress(2, 2), *progress(5, 3, first=4)])) == [3]


def test_a_scripts_intervals_are_its_clean_runs_widest_gaps() -> None:
    steps = [(3, "memory"), (6, "memory"), (9, "memory"), (10, "durable"), (12, "memory"),
             (20, "durable"), (21, "memory"), (24, "memory")]
    events = [commit(s, "a.0", s, 0, tier) for s, tier in steps]
    events.append(commit(30, "b.0", 30, 1, "memory"))  # rank 1's commits do not count
    assert widest_gap(events, durable_only=True) == 10
    assert widest_gap(events, durable_only=False) == 8  # 12 → 20
    assert widest_gap(events[:3], durable_only=True) is None


def test_a_script_run_whose_marks_do_not_cover_every_step_is_refused() -> None:
    opts = ChaosOptions(script="train.py", script_args=["{storage}"], peer=False)
    clean = [*progress(20, 2), commit(5, "a.0", 10, 0, "durable"),
             commit(5.5, "a.0", 12, 0, "memory"), commit(6, "a.0", 20, 0, "durable")]
    assert expectation(opts, clean) == Expectation(memory_every=10, durable_every=10)
    sparse = [e for e in clean if e.get("step") != 7]
    with pytest.raises(ElasticTrainError, match=r"no train.progress event for steps \[7\]"):
        expectation(opts, sparse)
    with pytest.raises(ElasticTrainError, match="no durable snapshot"):
        expectation(opts, [e for e in clean if e.get("tier") != "durable"])
