"""The event tail (partial lines, several writers, any Store), the reducer behind every
view, and the throttled ``train.progress`` event the views read step and loss from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from structlog.testing import capture_logs

import elastictrain as et
from elastictrain.storage import open_store
from elastictrain.view.model import RunState
from elastictrain.view.tail import EventTail


def line(**event: Any) -> bytes:
    return (json.dumps(event) + "\n").encode()


def test_tail_waits_for_the_newline_of_a_partial_line(tmp_path: Path) -> None:
    tail = EventTail(open_store(str(tmp_path)))
    (tmp_path / "run").mkdir()
    log = tmp_path / "run" / "attempt000-rank0.jsonl"
    whole = line(event="resume", ts=2.0, rank=0, restart_count=0, step=0)
    log.write_bytes(line(event="worker.start", ts=1.0) + whole[:10])
    assert [e["event"] for e in tail.poll()] == ["worker.start"]
    assert tail.poll() == []  # the half line is not consumed, nor lost
    with log.open("ab") as fh:
        fh.write(whole[10:])
    assert [e["event"] for e in tail.poll()] == ["resume"]
    assert tail.poll() == []


def test_tail_merges_files_in_time_order_and_skips_torn_lines(tmp_path: Path) -> None:
    (tmp_path / "node0").mkdir()
    (tmp_path / "torchelastic").mkdir()  # torchrun's logs: never read
    (tmp_path / "torchelastic" / "x.jsonl").write_bytes(line(event="not ours", ts=0.5))
    (tmp_path / "agent-h-1.jsonl").write_bytes(line(event="a", ts=1.0) + line(event="c", ts=3.0))
    (tmp_path / "node0" / "attempt000-rank1.jsonl").write_bytes(
        b'{"event": "torn' + b"\n" + line(event="b", ts=2.0))
    assert [e["event"] for e in EventTail(open_store(str(tmp_path))).poll()] == ["a", "b", "c"]


def test_tail_reads_through_a_non_local_store() -> None:
    store = open_store("memory://view-tail-test")
    store.write_bytes("events/attempt000-rank0.jsonl", line(event="a", ts=1.0) + b'{"ev')
    tail = EventTail(store, "events")
    assert [e["event"] for e in tail.poll()] == ["a"]
    store.write_bytes("events/attempt000-rank0.jsonl",
                      line(event="a", ts=1.0) + line(event="b", ts=2.0))
    assert [e["event"] for e in tail.poll()] == ["b"]


def kill_and_resume_events() -> list[dict[str, Any]]:
    """The events of a demo-like run: 2 workers, rank 1 SIGKILLed at step 12, resume at 10."""
    w = {"run_id": "r1", "world_size": 2}
    a = {"run_id": "r1", "role": "agent", "rank": None}
    return [
        {**a, "event": "agent.attempt_started", "restart_count": 0, "world_size": 2, "ts": 1.0},
        {**w, "event": "resume", "rank": 0, "restart_count": 0, "step": 0, "from_step": None,
         "ts": 2.0},
        {**w, "event": "train.progress", "rank": 0, "restart_count": 0, "step": 4,
         "loss": 3.5, "ts": 3.0},
        {**w, "event": "snapshot.committed", "rank": 0, "restart_count": 0, "step": 10,
         "snapshot_step": 10, "size_bytes": 2_000_000, "ts": 4.0},
        {**w, "event": "train.progress", "rank": 0, "restart_count": 0, "step": 12,
         "loss": 3.0, "ts": 5.0},
        {**a, "event": "agent.worker_failed", "restart_count": 0, "worker_rank": 1,
         "exit_code": -9, "signal": "SIGKILL", "ts": 6.0},
        {**a, "event": "agent.restart", "restart_count": 0, "reason": "failure",
         "from_restart_count": 1, "remaining_restarts": 2, "ts": 6.1},
        {**a, "event": "agent.attempt_started", "restart_count": 1, "world_size": 2, "ts": 6.2},
        {**w, "event": "resume", "rank": 0, "restart_count": 1, "step": 10, "from_step": 10,
         "lost_steps": 2, "world_size_changed": False, "ts": 8.0},
        {**w, "event": "resume", "rank": 1, "restart_count": 1, "step": 10, "from_step": 10,
         "lost_steps": 2, "ts": 8.0},
    ]


def test_reducer_follows_a_kill_restart_and_resume() -> None:
    state = RunState(total_steps=30)
    events = kill_and_resume_events()
    for event in events[:5]:
        state.apply(event)
    assert (state.attempt, state.step, state.loss) == (0, 12, 3.0)
    assert state.rate == (12 - 0) / (5.0 - 2.0)
    assert state.last_snapshot is not None and state.last_snapshot["step"] == 10
    for event in events[5:]:
        state.apply(event)
    assert (state.attempt, state.world_size, state.step) == (1, 2, 10)  # back to the resume
    assert state.rank_steps == {0: 10, 1: 10}
    assert state.rate is None  # a new attempt measures its own rate
    texts = [line.text for line in state.lines]
    assert texts == ["attempt 0: fresh start at world size 2",
                     "worker rank 1 killed by SIGKILL",
                     "restart after failure, attempt 1, 2 restarts left",
                     "attempt 1: resumed from step 10 (lost 2 steps)"]
    assert [line.kind for line in state.failures()] == ["failure"]
    assert not state.ended


def test_reducer_ends_with_the_launcher_or_without_one_with_rank_0() -> None:
    finished = {"run_id": "r", "event": "run.finished", "rank": 0, "restart_count": 0,
                "step": 5, "final_step": 5, "final_loss": 1.5, "ts": 2.0}
    plain = RunState()
    plain.apply(finished)  # plain torchrun: no agent events
    assert plain.ended and plain.finished == "finished" and plain.loss == 1.5
    launched = RunState()
    launched.apply({"run_id": "r", "role": "agent", "event": "agent.start", "ts": 1.0})
    launched.apply(finished)
    assert not launched.ended  # the launcher still has to exit
    launched.apply({"run_id": "r", "role": "agent", "event": "agent.finished",
                    "exit_code": 75, "outcome": "preempted", "ts": 3.0})
    assert launched.ended and launched.finished == "preempted"
    assert launched.lines[-1].text == "launcher exited 75 (preempted)"


def test_preemption_lines_say_notice_then_final_snapshot() -> None:
    state = RunState()
    base = {"run_id": "r", "restart_count": 0, "world_size": 2, "step": 7}
    for rank in (0, 1):  # every rank logs the notice it saw: one line
        state.apply({**base, "rank": rank, "event": "preempt.notice", "source": "SIGTERM",
                     "grace_period_s": 30.0, "ts": 1.0 + rank})
    state.apply({**base, "rank": 0, "event": "preempt.saved", "snapshot_step": 7,
                 "duration_s": 0.8, "ts": 3.0})
    assert [line.text for line in state.lines] == [
        "preemption notice (SIGTERM), grace 30.0 s",
        "final snapshot of step 7 committed 0.8 s after the notice"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_event_is_time_throttled_and_carries_the_loss(tmp_path: Path) -> None:
    clock = FakeClock()
    model = torch.nn.Linear(2, 1)
    snap = et.SnapshotManager(str(tmp_path), model=model, every_steps=None,
                              progress_every_s=2.0, clock=clock)
    with capture_logs() as logs:
        for step in range(1, 11):
            clock.now = step * 0.5  # 10 steps in 5 s: due at 2.0 and 4.0 s (steps 4 and 8)
            snap.step(loss=torch.tensor(float(step)))
    progress = [e for e in logs if e["event"] == "train.progress"]
    assert [e["loss"] for e in progress] == [4.0, 8.0]
    quiet = et.SnapshotManager(str(tmp_path), model=model, every_steps=None,
                               progress_every_s=None, clock=clock)
    with capture_logs() as logs:
        clock.now = 100.0
        quiet.step(loss=1.0)
    assert not [e for e in logs if e["event"] == "train.progress"]
    snap.close()
    quiet.close()


def test_a_suspect_restore_is_a_line_and_in_the_state() -> None:
    state = RunState()
    state.apply({"event": "snapshot.suspect", "ts": 5.0, "rank": 0, "restart_count": 1,
                 "snapshot_step": 20, "tier": "durable", "at_step": 24, "restore_next": 10,
                 "reason": "the loss is not finite (NaN or infinite) after the restore",
                 "action": "set aside; restarting from the snapshot before"})
    assert state.suspects == {20: "the loss is not finite (NaN or infinite) after the restore"}
    [shown] = state.failures()
    assert shown.text.startswith("snapshot 20 (durable) suspect after its restore, at step 24")
    assert shown.text.endswith("set aside, restarting from step 10")
    assert state.to_dict()["suspects"] == {"20": state.suspects[20]}


def test_a_worker_leaving_for_a_suspect_restore_is_one_line_without_a_traceback() -> None:
    state = RunState()
    state.apply({"event": "agent.worker_failed", "ts": 6.0, "role": "agent", "worker_rank": 0,
                 "exit_code": 1, "meaning": "error", "error": "SnapshotSuspect",
                 "where": "fallback.py:72", "first": True,
                 "traceback": ["  File \"fallback.py\", line 72", "SnapshotSuspect: …"]})
    [shown] = list(state.lines)
    assert shown.kind == "restart" and "\n" not in shown.text
    assert shown.text == ("worker rank 0 exited 1 (error): its restore was suspect, so the "
                          "group restarts from the snapshot before")
