"""Node memory across nodes when a second event follows the first, under real
``elastictrain run`` agents (gloo, CPU; two agents on this machine stand for two nodes,
one worker each, each with a memory directory of its own).

(a) A node comes back with its memory from a timeline the job left. Both nodes park
    after step 25 (memory of 25 on both); node B's processes are SIGKILLed while its
    memory directory survives. Node A's memory is lost too, so A alone restarts from
    durable step 20 and trains 21-25 again at world size 1 (other bits), then parks once
    more. B's replacement starts on B's old directory: both nodes now hold a step 25,
    from two attempts. The ranks agree on A's (the newer attempt's), B receives it, and
    both resume from the same state (their ``state_digest`` agree): never each its own.
(b) A replacement node's records rescue the next loss (below).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from elastictrain.core.env import SHM_VAR
from elastictrain.core.localfiles import user_dir_name
from tests.helpers import events, free_port, wait_for
from tests.processes.memtier.test_memtier_e2e import (
    PARK,
    STEPS,
    Agents,
    _log,
    _runs_job,
    _wait_parked,
    agents,
)
from tests.processes.memtier.test_peer_e2e import _kill_node

pytestmark = [pytest.mark.distributed, pytest.mark.processes]
__all__ = ["agents"]  # a fixture, used by name


def _last_resumes(ev: Path) -> list[dict[str, Any]]:
    """Each rank's last resume event."""
    last: dict[int, dict[str, Any]] = {}
    for e in sorted(events(ev, "resume"), key=lambda e: e["ts"]):
        last[e["rank"]] = e
    return [last[r] for r in sorted(last)]


def _memory_commits(ev: Path, step: int) -> int:
    return len([e for e in events(ev, "snapshot.committed")
                if e.get("tier") == "memory" and e["snapshot_step"] == step])


@pytest.mark.timeout(600)
def test_a_node_back_with_memory_from_a_left_timeline_receives_the_jobs_snapshot(
        tmp_path: Path, agents: Agents) -> None:
    common: dict[str, Any] = {
        "nnodes": "1:2", "endpoint": f"127.0.0.1:{free_port()}", "park": PARK,
        "extra": (f"--again={PARK}",),
        # No rescue: node A's restart must go back to durable step 20 and train 21-25
        # again (a rescue would commit A's step 25 from B's record instead). A parked
        # worker cannot answer its agent's request for a save when B's replacement joins
        # (a step 26 saved would make the test moot): the agent waits 2 s, not 30, for it.
        "env": {"ELASTICTRAIN_SNAPSHOT__RESCUE": "false",
                "ELASTICTRAIN_LAUNCH__RESCUE_TIMEOUT_S": "2"}}
    root, gates_a, gates_b = tmp_path / "run", tmp_path / "gates-a", tmp_path / "gates-b"
    node_a = agents.start("a", root, tmp_path / "mem-a", is_host=1, gates=gates_a, **common)
    node_b = agents.start("b", root, tmp_path / "mem-b", is_host=0, gates=gates_b, **common)
    ev = tmp_path / "ev"
    _wait_parked(gates_a, 1)
    pid_b = _wait_parked(gates_b, 1)
    wait_for(lambda: _memory_commits(ev / "a", PARK) == _memory_commits(ev / "b", PARK) == 1,
             60, "both nodes' memory snapshots of step 25")

    _kill_node(node_b, list(pid_b.values()), None)  # B's memory directory survives
    shutil.rmtree(tmp_path / "mem-a" / "snapshots")  # A's memory of step 25 is lost
    (gates_a / "go").write_text("")
    # A alone: back to durable step 20, steps 21-25 again at world size 1, parked again.
    _wait_parked(gates_a / "again", 1)
    wait_for(lambda: _memory_commits(ev / "a", PARK) == 2, 60, "A's second step 25 in memory")
    (first_b,) = [e for e in events(ev / "b", "snapshot.committed")
                  if e.get("tier") == "memory" and e["snapshot_step"] == PARK]
    second_a = [e for e in events(ev / "a", "snapshot.committed")
                if e.get("tier") == "memory" and e["snapshot_step"] == PARK][-1]
    assert second_a["attempt"] > first_b["attempt"]

    node_b2 = agents.start("b2", root, tmp_path / "mem-b", is_host=0,
                           gates=tmp_path / "gates-b2", **common)
    wait_for(lambda: events(ev / "b2", "resume"), 240, "the replacement's resume")
    (gates_a / "again" / "go").write_text("")
    assert node_a.wait(timeout=300) == 0, _log(agents)
    assert node_b2.wait(timeout=60) == 0, _log(agents)

    resumes = _last_resumes(ev)
    assert [(e["from_step"], e["tier"], e["world_size"]) for e in resumes] == \
        [(PARK, "memory", 2)] * 2
    finals = events(ev, "params.rank_digest")
    assert len(finals) == 2 and len({e["param_digest"] for e in finals}) == 1, finals
    assert len({e["state_digest"] for e in resumes}) == 1, resumes  # checked at the resume
    (received,) = events(ev / "b2", "snapshot.memory_received")
    assert (received["snapshot_step"], received["verified"]) == (PARK, True)


def _alive_workers(ev: Path) -> list[int]:
    """The PIDs of a node's workers that still run the test job."""
    return [int(e["pid"]) for e in events(ev, "worker.start") if _runs_job(int(e["pid"]))]


@pytest.mark.timeout(900)
def test_a_replacement_nodes_records_rescue_the_next_loss(tmp_path: Path,
                                                         agents: Agents) -> None:
    """(b) Node B is lost in the middle of step 26 and A rescues step 25 from B's
    record; B's replacement B2 joins (its agent's restart count is 0, A's is 1), both
    resume 25 and park in the middle of step 28; B2 is lost there. A must rescue step 27
    from B2's record: the records of every node carry the job's attempt, not each
    agent's restart count."""
    common: dict[str, Any] = {
        "nnodes": "2", "endpoint": f"127.0.0.1:{free_port()}", "gates": tmp_path / "gates",
        "extra": ("--memory-every=1000", f"--park-in={PARK + 1}", f"--again={PARK + 3}")}
    root, gates, ev = tmp_path / "run", tmp_path / "gates", tmp_path / "ev"
    node_a = agents.start("a", root, tmp_path / "mem-a", is_host=1, **common)
    node_b = agents.start("b", root, tmp_path / "mem-b", is_host=0, **common)
    _wait_parked(gates, 2)  # both in the middle of step 26
    _kill_node(node_b, _alive_workers(ev / "b"), tmp_path / "mem-b")
    (gates / "go").write_text("")
    wait_for(lambda: events(ev / "a", "snapshot.rescued")
             or events(ev / "a", "snapshot.rescue_skipped"), 120, "node A's first rescue")
    node_b2 = agents.start("b2", root, tmp_path / "mem-b2", is_host=0, **common)
    _wait_parked(gates / "again", 2)  # both in the middle of step 28
    restarts = {e["restart_count"] for e in events(ev, "resume")
                if e.get("from_step") == PARK}
    assert restarts == {0, 1}, restarts  # the two agents count differently
    _kill_node(node_b2, _alive_workers(ev / "b2"), tmp_path / "mem-b2")
    (gates / "again" / "go").write_text("")
    wait_for(lambda: len(events(ev / "a", "snapshot.rescued"))
             + len(events(ev / "a", "snapshot.rescue_skipped")) >= 2, 120,
             "node A's second rescue")
    node_b3 = agents.start("b3", root, tmp_path / "mem-b3", is_host=0, **common)
    assert node_a.wait(timeout=400) == 0, _log(agents)
    assert node_b3.wait(timeout=60) == 0, _log(agents)

    assert [e["snapshot_step"] for e in events(ev / "a", "snapshot.rescued")] == \
        [PARK, PARK + 2], events(ev / "a", "snapshot.rescue_skipped")
    resumes = _last_resumes(ev)
    assert [(e["from_step"], e["tier"]) for e in resumes] == [(PARK + 2, "memory")] * 2
    finals = events(ev, "params.rank_digest")
    assert len({e["param_digest"] for e in finals}) == 1, finals


def _membership_restart(ev: Path) -> bool:
    return any(e.get("reason") == "membership_change" for e in events(ev, "agent.restart"))


def _join_while_a_evaluates(tmp_path: Path, agents: Agents, park: int) -> Path:
    """Node A alone (``--nnodes 1:2``, no memory snapshot after step 1) parks after step
    ``park``; node B starts, and once A's agent has asked to take it in, A evaluates
    for 3 s and trains on. Both launchers must end 0; the events' directory."""
    common: dict[str, Any] = {
        "nnodes": "1:2", "endpoint": f"127.0.0.1:{free_port()}", "park": park,
        "gates": tmp_path / "gates", "extra": ("--memory-every=1000", "--eval-s=3")}
    root, ev = tmp_path / "run", tmp_path / "ev"
    node_a = agents.start("a", root, tmp_path / "mem-a", is_host=1, **common)
    _wait_parked(tmp_path / "gates", 1)
    node_b = agents.start("b", root, tmp_path / "mem-b", is_host=0, **common)
    wait_for(lambda: _membership_restart(ev / "a"), 120, "A's agent to take node B in")
    (tmp_path / "gates" / "go").write_text("")  # the evaluation (3 s) starts
    assert node_a.wait(timeout=300) == 0, _log(agents)
    assert node_b.wait(timeout=120) == 0, _log(agents)
    return ev


@pytest.mark.timeout(600)
def test_a_node_joining_while_the_workers_evaluate_repeats_no_step(
        tmp_path: Path, agents: Agents) -> None:
    """(c) Node A alone trains to step 25 (durable 20, no memory snapshot since step 1)
    and evaluates for 3 s; node B joins meanwhile. A's agent asks for a save before the
    restart: the evaluating worker is not ready until its next step, step 26, which it
    saves; both resume 26, and no step is trained twice."""
    ev = _join_while_a_evaluates(tmp_path, agents, PARK)

    assert not events(ev, "snapshot.restart_ready_idle")
    (saved,) = events(ev / "a", "snapshot.saved_for_restart")
    assert (saved["snapshot_step"], saved["tier"]) == (PARK + 1, "memory")
    resumes = _last_resumes(ev)
    assert [(e["from_step"], e["tier"], e["world_size"]) for e in resumes] == \
        [(PARK + 1, "memory", 2)] * 2
    finals = events(ev, "params.rank_digest")
    assert len(finals) == 2 and len({e["param_digest"] for e in finals}) == 1, finals


@pytest.mark.timeout(600)
def test_a_node_joining_while_the_workers_close_repeats_no_step(
        tmp_path: Path, agents: Agents) -> None:
    """(d) Node A alone trains its last step, 30 (durable 20, no memory snapshot since
    step 1), evaluates for 3 s and closes the run; node B joins meanwhile. close() saves
    step 30 before it tells the agent it is ready, so the group that takes B in resumes
    at 30 and trains nothing again (a closing worker that was ready at once, before any
    save, sent it back to step 20). Where A's worker ends before its agent restarts it,
    the run is simply over: no resume before step 30 either way."""
    ev = _join_while_a_evaluates(tmp_path, agents, STEPS)

    committed = [e["snapshot_step"] for e in events(ev / "a", "snapshot.committed")
                 if e.get("tier") != "memory"]
    assert committed.count(STEPS) == 1, committed  # saved once, by close()
    late = [e for e in events(ev, "resume") if e["from_step"] is not None
            and e["from_step"] < STEPS and e["ts"] > _parked_at(tmp_path / "gates")]
    assert not late, late
    # A's group finished, and the group that took B in too (it trained nothing).
    ends = [(e["final_step"], e["snapshot_step"]) for e in events(ev, "run.finished")
            if e["ts"] > _parked_at(tmp_path / "gates")]
    assert ends and set(ends) == {(STEPS, STEPS)}, ends


def _parked_at(gates: Path) -> float:
    """When the first park released (the go file's time)."""
    return (gates / "go").stat().st_mtime


@pytest.mark.timeout(600)
def test_a_rescue_is_not_stopped_by_a_membership_restart(tmp_path: Path,
                                                        agents: Agents) -> None:
    """(d) Both nodes park in the middle of step 26 with 1 GB of state each; node B is
    lost and its replacement B2 enters the rendezvous before A's worker meets the loss:
    A's agent sees a healthy group and a node waiting, and restarts for the membership
    change. A's worker then meets B's death and rescues step 25 (seconds, at this
    size): the agent waits for the rescue instead of stopping the worker, and the new
    group resumes 25 from memory."""
    common: dict[str, Any] = {
        "nnodes": "2", "endpoint": f"127.0.0.1:{free_port()}", "gates": tmp_path / "gates",
        "extra": ("--memory-every=1000", f"--park-in={PARK + 1}", "--frozen-mb=1000")}
    root, gates, ev = tmp_path / "run", tmp_path / "gates", tmp_path / "ev"
    node_a = agents.start("a", root, tmp_path / "mem-a", is_host=1, **common)
    node_b = agents.start("b", root, tmp_path / "mem-b", is_host=0, **common)
    _wait_parked(gates, 2)
    _kill_node(node_b, _alive_workers(ev / "b"), tmp_path / "mem-b")
    node_b2 = agents.start("b2", root, tmp_path / "mem-b2", is_host=0, **common)
    wait_for(lambda: _membership_restart(ev / "a"), 120, "A's agent to take node B2 in")
    (gates / "go").write_text("")  # A's backward meets B's death: the rescue
    assert node_a.wait(timeout=400) == 0, _log(agents)
    assert node_b2.wait(timeout=60) == 0, _log(agents)

    assert [e["snapshot_step"] for e in events(ev / "a", "snapshot.rescued")] == [PARK], \
        events(ev / "a", "snapshot.rescue_skipped")
    resumes = _last_resumes(ev)
    assert [(e["from_step"], e["tier"]) for e in resumes] == [(PARK, "memory")] * 2


@pytest.mark.timeout(600)
def test_a_node_without_rescue_marks_calls_the_same_collectives(tmp_path: Path,
                                                               agents: Agents) -> None:
    """(e) Node B's launcher finds its shared-memory root open to others (0755) and goes
    on without rescue marks (degraded: its agent cannot ask for a save before a
    restart); preemption handling is off. Its workers still take part in every per-step
    agreement node A's workers call: the run ends as an undisturbed one does."""
    shm_b = tmp_path / "shm-b"
    (shm_b / user_dir_name("elastictrain")).mkdir(parents=True, mode=0o755)
    os.chmod(shm_b / user_dir_name("elastictrain"), 0o755)
    common: dict[str, Any] = {"nnodes": "2", "endpoint": f"127.0.0.1:{free_port()}"}
    off = {"ELASTICTRAIN_PREEMPT__ENABLED": "false"}
    root, ev = tmp_path / "run", tmp_path / "ev"
    node_a = agents.start("a", root, tmp_path / "mem-a", is_host=1, env=off, **common)
    node_b = agents.start("b", root, tmp_path / "mem-b", is_host=0,
                          env={**off, SHM_VAR: str(shm_b)}, **common)
    assert node_a.wait(timeout=240) == 0, _log(agents)
    assert node_b.wait(timeout=60) == 0, _log(agents)

    (degraded,) = events(ev / "b", "snapshot.memory_degraded")
    assert degraded["what"] == "rescue marks"
    assert not events(ev, "watchdog.fired") and not events(ev, "agent.restart")
    finals = events(ev, "params.rank_digest")
    assert len(finals) == 2 and len({e["param_digest"] for e in finals}) == 1, finals
