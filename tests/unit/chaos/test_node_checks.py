"""The node trial's checks and schedule: each passes a good trial and fails the bad one
it exists for, on made-up events and records (the real jobs: test_chaos_nodes.py)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from elastictrain.chaos.dataonce import check_exactly_once
from elastictrain.chaos.nodechecks import (
    NODE_KEY,
    Expectation,
    Loss,
    NodeLife,
    check_agents,
    check_node_resumes,
    complete_memory_step,
    newest_held,
)
from elastictrain.chaos.schedule import make_schedule, parse_kinds
from elastictrain.core.errors import ConfigError
from elastictrain.worker.data import ElasticSampler

LOCAL = Expectation(memory_every=3, durable_every=10)
PEER = Expectation(memory_every=3, durable_every=10, peer_restore=True, cross_node_rescue=True)
def ev(name: str, ts: float, node: str, rank: int = 0, **fields: Any) -> dict[str, Any]:
    return {"event": name, "ts": ts, "rank": rank, NODE_KEY: node, **fields}


def memory(ts: float, node: str, step: int, rank: int) -> dict[str, Any]:
    return ev("snapshot.committed", ts, node, rank, snapshot_step=step, tier="memory")


def trained(upto: int, ts: float) -> list[dict[str, Any]]:
    return [{"step": s, "ts": ts + s / 100} for s in range(1, upto + 1)]


# Two nodes train to step 14: durable 10, memory 12 on both, then node b is lost at 20.
BEFORE = [ev("resume", 1, "a.0", from_step=None),
          ev("snapshot.committed", 5, "a.0", snapshot_step=10, tier="durable"),
          memory(6, "a.0", 12, 0), memory(6.1, "b.0", 12, 1)]
A, B = NodeLife("a.0", 0, None), NodeLife("b.0", 0, 20)
B_NEW = NodeLife("b.1", 25, None)
def test_memory_held_follows_commits_prunes_and_the_loss() -> None:
    events = [*BEFORE, memory(7, "a.0", 15, 0),
              ev("snapshot.pruned", 7.1, "a.0", snapshot_step=12, tier="memory")]
    assert newest_held(events, A, 8) == (-1, 15)  # committed before attempts were named
    assert newest_held(events, A, 6.5) == (-1, 12)
    assert newest_held(events, B, 8) == (-1, 12)
    assert newest_held(events, B, 21) is None  # lost: its memory is gone
    assert newest_held(events, B_NEW, 30) is None  # a replacement starts empty
    # The restore's own removal of newer copies does not hide them from the check.
    stale = [*BEFORE, ev("snapshot.pruned", 30, "a.0", snapshot_step=12, tier="memory",
                         reason="stale")]
    assert newest_held(stale, A, 31, since=29) == (-1, 12)
    assert newest_held(stale, A, 31, since=30.5) is None


def test_a_node_back_on_kept_memory_holds_what_it_held() -> None:
    """``stale``: node b's memory outlived it; its replacement starts on it."""
    kept = NodeLife("b.1", 25, None, inherits="b.0")
    events = [*BEFORE, ev("snapshot.committed", 7, "b.0", snapshot_step=13, tier="memory",
                          attempt=2)]
    assert newest_held(events, kept, 30) == (2, 13)
    assert newest_held(events, B_NEW, 30) is None  # without the kept memory: empty


def test_a_complete_copy_needs_every_node_without_peers_and_one_with_them() -> None:
    assert complete_memory_step({"a": (1, 12), "b": (1, 12)}, peer_restore=False) == 12
    assert complete_memory_step({"a": (1, 12), "b": None}, peer_restore=False) is None
    assert complete_memory_step({"a": (1, 12), "b": (1, 9)}, peer_restore=False) is None
    assert complete_memory_step({"a": (1, 12), "b": None}, peer_restore=True) == 12
    assert complete_memory_step({"a": (1, 12), "b": (1, 9)}, peer_restore=True) == 12
    assert complete_memory_step({"a": None}, peer_restore=True) is None
    # The newest attempt's copy, whatever step an earlier attempt reached; none that
    # an attempt before the durable snapshot's took.
    assert complete_memory_step({"a": (3, 13), "b": (2, 16)}, peer_restore=True) == 13
    assert complete_memory_step({"a": (3, 13), "b": (3, 13)}, peer_restore=True,
                                durable=(3, 13)) is None
    assert complete_memory_step({"a": (2, 16), "b": None}, peer_restore=True,
                                durable=(3, 14)) is None
    assert complete_memory_step({"a": (2, 16), "b": (3, 15)}, peer_restore=True,
                                durable=(3, 14)) == 15


def test_a_shrunk_job_must_restore_the_memory_every_survivor_holds() -> None:
    """Node b lost, not replaced: node a alone holds memory step 12 (> durable 10)."""
    records = trained(14, 2)
    good = [*BEFORE, ev("resume", 22, "a.0", from_step=12, tier="memory")]
    assert check_node_resumes(good, [A, B], records, LOCAL, Loss(20, silent=False)) is None
    durable = [*BEFORE, ev("resume", 22, "a.0", from_step=10, tier="durable")]
    assert "although step 12 was complete" in str(
        check_node_resumes(durable, [A, B], records, LOCAL, Loss(20, silent=False)))


def test_a_replaced_node_means_durable_without_peers_and_memory_with_them() -> None:
    records = trained(14, 2)
    lives = [A, B, B_NEW]
    durable = [*BEFORE, ev("resume", 30, "a.0", from_step=10, tier="durable")]
    assert check_node_resumes(durable, lives, records, LOCAL, Loss(20, silent=True)) is None
    failure = check_node_resumes(durable, lives, records, PEER, Loss(20, silent=True))
    assert "although step 12 was complete" in str(failure)
    from_peer = [*BEFORE, ev("resume", 30, "a.0", from_step=12, tier="memory")]
    assert check_node_resumes(from_peer, lives, records, PEER, Loss(20, silent=True)) is None


def test_lost_steps_are_bounded_by_the_tier_and_by_the_rescue() -> None:
    resume = [*BEFORE, ev("resume", 22, "a.0", from_step=12, tier="memory")]
    assert check_node_resumes(resume, [A, B], trained(15, 2), LOCAL, Loss(20, False)) is None
    assert "lost 4 steps" in str(
        check_node_resumes(resume, [A, B], trained(16, 2), LOCAL, Loss(20, False)))
    # With the rescue across nodes an abrupt loss costs at most one step; a silent one
    # (a hang, ended by the watchdog's kill) rescues nothing.
    rescued = [*BEFORE, memory(21, "a.0", 14, 0),
               ev("resume", 22, "a.0", from_step=14, tier="memory")]
    assert check_node_resumes(rescued, [A, B], trained(15, 2), PEER, Loss(20, False)) is None
    assert "allowed 1" in str(
        check_node_resumes(resume, [A, B], trained(15, 2), PEER, Loss(20, False)))
    assert check_node_resumes(resume, [A, B], trained(15, 2), PEER, Loss(20, True)) is None


def test_a_node_lost_while_it_ran_the_job_alone_has_no_survivor_to_rescue_it() -> None:
    """The other node's agent was still waiting to join (the group had one node): the
    loss keeps only what was committed, within the tier's interval."""
    alone = [ev("agent.attempt_started", 1, "b.0", group_world_size=1), *BEFORE,
             ev("resume", 22, "a.0", from_step=12, tier="memory")]
    assert check_node_resumes(alone, [A, B], trained(15, 2), PEER, Loss(20, False)) is None
    together = [ev("agent.attempt_started", 1, "b.0", group_world_size=2), *alone[1:]]
    assert "allowed 1" in str(
        check_node_resumes(together, [A, B], trained(15, 2), PEER, Loss(20, False)))


def test_a_join_the_group_saved_for_may_lose_no_step() -> None:
    """A node joins (no loss): the group saved step 15, the step it stood at, before it
    re-formed, so the resume must start there; where it was not stopped in time (it trained
    on) the memory interval applies as before."""
    saved = ev("snapshot.saved_for_restart", 21, "a.0", snapshot_step=15, tier="memory")
    at_15 = [*BEFORE, saved, memory(21, "a.0", 15, 0),
             ev("resume", 22, "a.0", from_step=15, tier="memory")]
    assert check_node_resumes(at_15, [A], trained(15, 2), PEER, None) is None
    at_12 = [*BEFORE, saved, ev("resume", 22, "a.0", from_step=12, tier="memory")]
    assert "allowed 0" in str(check_node_resumes(at_12, [A], trained(15, 2), PEER, None))
    not_taken = ev("snapshot.restart_not_taken", 21.5, "a.0", snapshot_step=15)
    assert check_node_resumes([*at_12[:-1], not_taken, at_12[-1]], [A], trained(15, 2),
                              PEER, None) is None


def test_a_record_still_in_flight_at_the_loss_allows_the_memory_interval() -> None:
    """Node b's loop draws random numbers between its optimizer step and its boundary,
    so its records go at the boundary; it died after step 15's all-reduce but before
    its record of 15 left: the survivor skipped that rescue and the resume may lose the
    memory interval, but only if b's records had been arriving until then. Where the
    records go before the optimizer step, the same skip is a failure."""
    skipped = ev("snapshot.rescue_skipped", 20.5, "a.0", snapshot_step=15,
                 reason="no record of step 15 on this node for rank(s) [1] (on another node, "
                        "or killed while writing or sending it)")
    stopped = ev("snapshot.records_stopped", 20.4, "a.0", direction="receive", source=1,
                 received=14)
    at_boundary = ev("snapshot.records_pre_step_off", 5, "b.0", step=3)
    resume = [*BEFORE, at_boundary, skipped,
              ev("resume", 22, "a.0", from_step=12, tier="memory")]
    races = [*resume[:-1], stopped, resume[-1]]
    assert check_node_resumes(races, [A, B], trained(15, 2), PEER, Loss(20, False)) is None
    pre_step = [e for e in races if e is not at_boundary]
    assert "allowed 1" in str(
        check_node_resumes(pre_step, [A, B], trained(15, 2), PEER, Loss(20, False)))
    assert "allowed 1" in str(  # no record had ever arrived: not the race
        check_node_resumes(resume, [A, B], trained(15, 2), PEER, Loss(20, False)))
    other_step = [*BEFORE, {**skipped, "reason": skipped["reason"].replace("15", "14")},
                  stopped, ev("resume", 22, "a.0", from_step=12, tier="memory")]
    assert "allowed 1" in str(
        check_node_resumes(other_step, [A, B], trained(15, 2), PEER, Loss(20, False)))


def test_every_launcher_not_killed_must_exit_zero() -> None:
    assert check_agents({"a.0": [0], "b.0": [-9], "b.1": [0]}, {"b.0"}, timed_out=False) is None
    assert "did not finish" in str(check_agents({"a.0": [1], "b.0": [-9]}, {"b.0"},
                                                timed_out=False))
    assert "timed out" in str(check_agents({"a.0": [0]}, set(), timed_out=True))


def write_records(directory: Path, steps: list[tuple[int, str, int, list[list[int]]]]) -> None:
    """(step, world, epoch, samples per rank) → one file per (world, rank)."""
    directory.mkdir(parents=True, exist_ok=True)
    for n, (step, world, epoch, per_rank) in enumerate(steps):
        for rank, samples in enumerate(per_rank):
            line = {"world": world, "step": step, "epoch": epoch, "rank": rank,
                    "world_size": len(per_rank), "samples": samples, "ts": n + rank / 10}
            with open(directory / f"{world}-rank{rank}.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")


def test_exactly_once_across_a_shrink_and_a_redone_step(tmp_path: Path) -> None:
    order = ElasticSampler(10, 1, seed=0).epoch_order(0)
    steps = [(1, "w1", 0, [order[0:2], order[2:4]]),
             (2, "w1", 0, [order[4:6], order[6:8]]),  # redone by w2 after the loss
             (2, "w2", 0, [order[4:6]]), (3, "w2", 0, [order[6:8]]),
             (4, "w2", 0, [order[8:10]])]
    write_records(tmp_path / "ok", steps)
    assert check_exactly_once(tmp_path / "ok", 10, 0, 4) is None
    twice = [*steps[:-1], (4, "w2", 0, [order[6:8]])]
    write_records(tmp_path / "twice", twice)
    assert "twice" in str(check_exactly_once(tmp_path / "twice", 10, 0, 4))
    write_records(tmp_path / "gap", steps[:3])
    assert "never trained" in str(check_exactly_once(tmp_path / "gap", 10, 0, 4))
    write_records(tmp_path / "torn", steps[:4])
    with open(tmp_path / "torn" / "w3-rank0.jsonl", "w") as f:  # rank 1 of w3 never wrote
        f.write(json.dumps({"world": "w3", "step": 4, "epoch": 0, "rank": 0, "world_size": 2,
                            "samples": order[8:10], "ts": 9}) + "\n")
    assert "ranks [0] of 2" in str(check_exactly_once(tmp_path / "torn", 10, 0, 4))


def test_node_kinds_combine_only_with_storage() -> None:
    assert parse_kinds("node,storage") == ("node", "storage")
    with pytest.raises(ConfigError, match="node combines only with storage"):
        parse_kinds("node,kill")


def test_node_faults_replay_and_cover_every_variant() -> None:
    draws = [make_schedule(4, t, ("node",), 30.0, 2, nodes=3, steps=60).node for t in range(60)]
    assert draws == [make_schedule(4, t, ("node",), 30.0, 2, nodes=3, steps=60).node
                     for t in range(60)]
    assert all(d is not None for d in draws)
    faults = [d for d in draws if d is not None]
    assert {f.node for f in faults} == {0, 1, 2}
    assert {(f.replace, f.silent) for f in faults} == {(a, b) for a in (0, 1) for b in (0, 1)}
    assert any(f.at_step is None for f in faults)  # some during start-up
    assert all(1 <= f.at_step <= 58 for f in faults if f.at_step is not None)
    forced = [make_schedule(4, t, ("node",), 30.0, 2, nodes=2, replace=False).node
              for t in range(20)]
    assert {f.replace for f in forced if f is not None} == {False}
    # The storage draws do not move when node faults are asked for beside them.
    assert make_schedule(4, 3, ("node", "storage"), 30.0, 2).storage == make_schedule(
        4, 3, ("storage",), 30.0, 2).storage


def test_join_brings_back_only_a_node_not_replaced_and_replays_the_loss() -> None:
    """``join``: a trial whose lost node is not replaced takes it back after a drawn
    number of steps; the loss itself is drawn as without ``join`` (seeds replay)."""
    plain = [make_schedule(4, t, ("node",), 30.0, 2, nodes=2).node for t in range(40)]
    joins = [make_schedule(4, t, ("node", "join"), 30.0, 2, nodes=2).node for t in range(40)]
    for without, with_join in zip(plain, joins, strict=True):
        assert without is not None and with_join is not None
        assert replace(with_join, rejoin_after_steps=None) == without
        if without.replace:
            assert with_join.rejoin_after_steps is None
        else:
            assert with_join.rejoin_after_steps is not None
            assert 1 <= with_join.rejoin_after_steps <= 5
            assert "rejoins after" in with_join.describe()
    assert all(f is not None and f.rejoin_after_steps is None for f in plain)
    assert any(f is not None and f.rejoin_after_steps for f in joins)
    assert parse_kinds("node,join") == ("node", "join")
    with pytest.raises(ConfigError, match="join is a lost node coming back"):
        parse_kinds("join")


def test_stale_keeps_the_lost_nodes_memory_on_some_trials_and_replays_the_loss() -> None:
    """``stale``: on about half the trials the lost node's memory is kept (it comes back
    on it); the loss and the rejoin are drawn as without ``stale``."""
    plain = [make_schedule(4, t, ("node", "join"), 30.0, 2, nodes=2).node for t in range(40)]
    kept = [make_schedule(4, t, ("node", "join", "stale"), 30.0, 2, nodes=2).node
            for t in range(40)]
    for without, with_stale in zip(plain, kept, strict=True):
        assert without is not None and with_stale is not None
        assert replace(with_stale, keep_memory=False) == without
        assert ("memory kept" in with_stale.describe()) == with_stale.keep_memory
    assert 10 <= sum(f is not None and f.keep_memory for f in kept) <= 30
    with pytest.raises(ConfigError, match="stale is a lost node coming back"):
        parse_kinds("stale")


def test_second_loses_a_node_again_only_after_a_comeback() -> None:
    """``second``: a node is lost again once the lost one is back (replaced, or a
    rejoin drawn); the first loss replays as without ``second``."""
    kinds = ("node", "join")
    plain = [make_schedule(4, t, kinds, 30.0, 2, nodes=2).node for t in range(40)]
    drawn = [make_schedule(4, t, (*kinds, "second"), 30.0, 2, nodes=2).node for t in range(40)]
    for without, with_second in zip(plain, drawn, strict=True):
        assert without is not None and with_second is not None
        assert replace(with_second, second=None, second_after_steps=0) == without
        comes_back = without.replace or without.rejoin_after_steps is not None
        assert (with_second.second is not None) == comes_back
        if with_second.second is not None:
            assert 1 <= with_second.second_after_steps <= 5
            assert "lost" in with_second.describe().split("then node")[-1]


def test_a_resume_after_two_abrupt_losses_may_lose_one_step_each_time() -> None:
    """Two abrupt losses, each followed by a resume: with the rescue across nodes each
    resume may lose at most the step in progress."""
    lives = [A, B, B_NEW]
    events = [*BEFORE, ev("resume", 30, "a.0", from_step=14, tier="memory"),
              ev("resume", 40, "a.0", from_step=28, tier="memory")]
    losses = [Loss(20, silent=False), Loss(35, silent=False)]
    two_records = [*trained(14, 2), *[{"step": s, "ts": 36 + s / 100} for s in range(15, 30)]]
    assert check_node_resumes(events, lives, two_records, PEER, losses) is None
    late = [*BEFORE, ev("resume", 30, "a.0", from_step=14, tier="memory"),
            ev("resume", 40, "a.0", from_step=25, tier="memory")]
    assert "lost 4 steps" in str(check_node_resumes(late, lives, two_records, PEER, losses))


def test_degraded_draws_a_node_on_some_trials_and_replays_the_loss() -> None:
    plain = [make_schedule(4, t, ("node",), 30.0, 3, nodes=3).node for t in range(40)]
    drawn = [make_schedule(4, t, ("node", "degraded"), 30.0, 3, nodes=3).node
             for t in range(40)]
    for without, with_degraded in zip(plain, drawn, strict=True):
        assert without is not None and with_degraded is not None
        assert replace(with_degraded, degraded=None) == without
    degraded = [f.degraded for f in drawn if f is not None and f.degraded is not None]
    assert 10 <= len(degraded) <= 30 and set(degraded) == {0, 1, 2}


def test_pause_draws_a_pause_on_some_rejoins_and_replays_the_rest() -> None:
    """``pause``: on about half the trials whose lost node rejoins, the job pauses as it
    does (1-6 s); everything else is drawn as without ``pause``."""
    kinds = ("node", "join")
    plain = [make_schedule(4, t, kinds, 30.0, 2, nodes=2).node for t in range(80)]
    drawn = [make_schedule(4, t, (*kinds, "pause"), 30.0, 2, nodes=2).node for t in range(80)]
    for without, with_pause in zip(plain, drawn, strict=True):
        assert without is not None and with_pause is not None
        assert replace(with_pause, pause_s=0.0) == without
        if with_pause.pause_s:
            assert with_pause.rejoin_after_steps is not None
            assert 1.0 <= with_pause.pause_s <= 6.0
            assert f"during a {with_pause.pause_s:g}s pause" in with_pause.describe()
    rejoins = [f for f in drawn if f is not None and f.rejoin_after_steps is not None]
    paused = [f for f in rejoins if f.pause_s]
    assert 0.25 * len(rejoins) <= len(paused) <= 0.75 * len(rejoins)
    with pytest.raises(ConfigError, match="pause is a pause in training"):
        parse_kinds("node,pause")
    assert parse_kinds("node,join,pause") == ("node", "join", "pause")


def test_a_join_during_a_pause_may_lose_no_step() -> None:
    """The job paused as node b came back (at 20.5): the join's restart waits for the
    pause to end and saves the step it stood at, so the resume starts at step 15 even
    where the group's save never showed (a save that did not happen is the bug)."""
    at_15 = [*BEFORE, memory(21, "a.0", 15, 0),
             ev("resume", 22, "a.0", from_step=15, tier="memory")]
    assert check_node_resumes(at_15, [A], trained(15, 2), PEER, None, [20.5]) is None
    at_12 = [*BEFORE, ev("resume", 22, "a.0", from_step=12, tier="memory")]
    assert check_node_resumes(at_12, [A], trained(15, 2), PEER, None) is None
    found = check_node_resumes(at_12, [A], trained(15, 2), PEER, None, [20.5])
    assert "lost 3 steps at a join during a pause" in str(found)
    # A pause whose join came after the loss the resume follows is that loss's.
    assert check_node_resumes(at_12, [A, B], trained(15, 2), LOCAL, Loss(20, False),
                              [20.5]) is None


