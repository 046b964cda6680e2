"""The status and live-view model over a run of several launches (one storage, several
commands: runlog/run_marker.py): it follows the newest launch, whose attempts count from
0 again; and a loss reported steps ago says its step."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from elastictrain.storage import open_store
from elastictrain.view.live import LiveView
from elastictrain.view.model import RunState

A, B = "20261129T120000Z-aaaa", "20261129T120100Z-bbbb"


def test_the_status_follows_the_newest_launch_from_attempt_0() -> None:
    state = RunState()
    for event in [
        {"event": "worker.start", "ts": 1.0, "launch_id": A, "restart_count": 2, "rank": 0,
         "step": 0},
        {"event": "train.progress", "ts": 2.0, "launch_id": A, "restart_count": 2,
         "rank": 0, "step": 30},
        {"event": "agent.finished", "ts": 3.0, "launch_id": A, "role": "agent",
         "exit_code": 75, "outcome": "preempted"},
        {"event": "worker.start", "ts": 10.0, "launch_id": B, "restart_count": 0, "rank": 0,
         "step": 0},
        {"event": "resume", "ts": 11.0, "launch_id": B, "restart_count": 0, "rank": 0,
         "step": 30, "from_step": 30, "lost_steps": 0},
        {"event": "train.progress", "ts": 12.0, "launch_id": B, "restart_count": 0,
         "rank": 0, "step": 35},
    ]:
        state.apply(event)
    data = state.to_dict()
    assert (data["step"], data["attempt"], data["launch"], data["launches"]) == (35, 0, B, 2)
    assert data["finished"] is None and not state.ended  # the new launch runs


def test_a_loss_reported_steps_ago_is_shown_with_its_step() -> None:
    """Progress (and its loss) comes every few seconds; other events move the step on:
    the loss then says which step it is from, never passes for the current one."""
    state = RunState()
    base = {"launch_id": A, "restart_count": 0, "rank": 0}
    state.apply({**base, "event": "train.progress", "ts": 1.0, "step": 190, "loss": 1.3584})
    assert state.loss_text() == "loss 1.3584"
    state.apply({**base, "event": "snapshot.staged", "ts": 2.0, "step": 200,
                 "snapshot_step": 200})
    assert state.loss_text() == "loss 1.3584 at step 190"
    assert state.to_dict()["loss_step"] == 190


def test_the_run_is_named_by_its_workers_not_by_a_relaunched_launcher() -> None:
    """A relaunch's launcher starts under an id of its own; its workers adopt the id
    the storage names, and the view shows that one whatever comes last."""
    state = RunState()
    state.apply({"event": "agent.start", "ts": 1.0, "role": "agent", "run_id": "et-new"})
    assert state.run_id == "et-new"  # nothing better known yet
    state.apply({"event": "resume", "ts": 2.0, "rank": 0, "restart_count": 0, "step": 8,
                 "run_id": "et-first"})
    state.apply({"event": "agent.finished", "ts": 3.0, "role": "agent", "run_id": "et-new",
                 "exit_code": 0, "outcome": "finished"})
    assert state.run_id == "et-first"


def test_the_run_views_heading_names_the_run_its_workers_name(tmp_path: Path) -> None:
    view = LiveView(open_store(str(tmp_path)), "", "elastictrain run", run_id="et-launcher",
                    console=Console(file=io.StringIO()))
    assert view._heading() == "elastictrain run et-launcher"  # before any event
    view.state.apply({"event": "resume", "ts": 2.0, "rank": 0, "restart_count": 0,
                      "step": 8, "run_id": "et-storage"})
    assert view._heading() == "elastictrain run et-storage"
