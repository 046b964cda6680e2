"""A node lost without notice with sharded (FSDP2) state, under real ``elastictrain
run`` agents (gloo, CPU): two agents on this machine stand for two nodes, one worker
each, each with a memory directory of its own. Node B's whole process tree (agent,
standby, worker) is SIGKILLed by PID and its memory directory wiped.

Memory snapshot every step, durable every 20, parked after step 25: each rank's shards
are in its node's memory and, with ``memory_replicas = 1``, in the other node's too. A
replacement node B' (empty memory) joins; both ranks resume step 25 from memory, B'
from the parts it received from node A (``peer_rank``), no durable read; the final
parameters are bit-exact with a clean run. With ``memory_replicas = 0`` node A holds
only rank 0's shards: both resume durable step 20.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest

from elastictrain.snapshot.format.reader import list_snapshot_dirs, read_manifest
from elastictrain.snapshot.sharded.memory_node import complete, read_held
from elastictrain.storage import open_store
from tests.helpers import events, wait_for
from tests.processes.memtier.nodejobs import stats_under
from tests.processes.memtier.test_memtier_e2e import (
    EVERY,
    PARK,
    Agents,
    _digest,
    _log,
    _memory_committed,
    _wait_parked,
    agents,
)
from tests.processes.memtier.test_peer_e2e import _kill_node, _last_ranks, _resumes, _two_nodes

pytestmark = [pytest.mark.distributed, pytest.mark.processes]
__all__ = ["agents"]  # a fixture, used by name

FSDP = "--fsdp"


def _last_resume(ev: Path, rank: int | None = None) -> dict[str, Any]:
    """The last resume from a snapshot logged on one node (by ``rank``, if given)."""
    resumes = [e for e in events(ev, "resume") if e.get("from_step") is not None
               and rank in (None, e["rank"])]
    return max(resumes, key=lambda e: e["ts"])


def _held_here(mem: Path, step: int) -> tuple[bool, int]:
    """Whether node memory ``mem`` holds the whole step, and how many parts it holds."""
    store = open_store(str(mem))
    manifest = read_manifest(store, step)
    held = read_held(store, step)
    return complete(manifest, held), len([n for n in held if n.endswith(".distcp")])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("replicas", [1, 0])
def test_replaced_node_restores_sharded_state_from_its_buddy(
        tmp_path: Path, agents: Agents, fsdp_reference: str, replicas: int) -> None:
    node_a, node_b, common = _two_nodes(
        agents, tmp_path, "2", extra=(FSDP, f"--park={PARK}"),
        env={"ELASTICTRAIN_SNAPSHOT__MEMORY_REPLICAS": str(replicas)})
    pids = _wait_parked(tmp_path / "gates", 2)
    wait_for(lambda: _memory_committed(tmp_path / "ev", PARK, 2), 60,
             "both nodes' memory snapshots of step 25")
    assert list_snapshot_dirs(open_store(str(tmp_path / "run"))) == [EVERY]
    # Each node holds its own rank's part, and with a buddy the other rank's too.
    for mem in (tmp_path / "mem-a", tmp_path / "mem-b"):
        assert _held_here(mem, PARK) == (replicas == 1, 1 + replicas)
        assert list_snapshot_dirs(open_store(str(mem))) == [PARK]  # keep=1
    _kill_node(node_b, [pids[1]], tmp_path / "mem-b")
    (tmp_path / "gates" / "go").write_text("")
    node_b2 = agents.start("b2", tmp_path / "run", tmp_path / "mem-b2", is_host=0, **common)
    assert node_a.wait(timeout=600) == 0, _log(agents)
    assert node_b2.wait(timeout=60) == 0, _log(agents)

    ev = tmp_path / "ev"
    # Rank 0 of the last attempt logs it, on whichever node the rendezvous put it.
    assert _digest(ev) == fsdp_reference  # bit-exact, from either tier
    if replicas == 0:  # A lacks rank 1's shards, B2 holds nothing: durable
        assert _resumes(ev) == [(0, EVERY, "durable", None), (1, EVERY, "durable", None)]
        assert not events(ev, "snapshot.memory_received")
        (skipped,) = [e for e in events(ev / "a", "snapshot.memory_skipped")
                      if e.get("durable_step") == EVERY]
        assert "no live node holds" in skipped["reason"]  # rank 1's part died with B
        return
    # The new attempt's ranks are the rendezvous's choice: A's rank may be 0 or 1.
    on_a, on_b2 = _last_resume(ev / "a"), _last_resume(ev / "b2")
    assert (on_a["from_step"], on_a["tier"], on_a["peer_rank"]) == (PARK, "memory", None)
    assert (on_b2["from_step"], on_b2["tier"], on_b2["peer_rank"]) == \
        (PARK, "memory", on_a["rank"])
    (received,) = events(ev / "b2", "snapshot.memory_received")
    # Rank 0's and rank 1's parts, DCP's metadata and the training state: all from A.
    assert (received["snapshot_step"], received["from_rank"], received["verified"],
            received["objects"]) == (PARK, on_a["rank"], True, 4)
    (sent,) = events(ev / "a", "snapshot.memory_sent")
    assert (sent["snapshot_step"], sent["to_rank"], sent["error"]) == \
        (PARK, on_b2["rank"], None)
    # No durable snapshot was read after the loss (the fresh start read none either).
    assert [e for e in events(ev, "snapshot.loaded") if e["tier"] == "durable"] == []
    assert not (tmp_path / "mem-a").exists() and not (tmp_path / "mem-b2").exists()


@pytest.mark.timeout(900)
def test_resized_job_restores_sharded_state_at_one_rank(tmp_path: Path, agents: Agents) -> None:
    """Not replaced (``--nnodes 1:2``): node A alone resumes step 25 from its memory,
    which holds both ranks' parts, resharded onto one rank."""
    node_a, node_b, _ = _two_nodes(agents, tmp_path, "1:2", extra=(FSDP, f"--park={PARK}"))
    pids = _wait_parked(tmp_path / "gates", 2)
    wait_for(lambda: _memory_committed(tmp_path / "ev", PARK, 2), 60,
             "both nodes' memory snapshots of step 25")
    _kill_node(node_b, [pids[1]], tmp_path / "mem-b")
    (tmp_path / "gates" / "go").write_text("")
    assert node_a.wait(timeout=600) == 0, _log(agents)
    ev = tmp_path / "ev"
    resume = _last_resume(ev / "a")
    assert (resume["from_step"], resume["tier"], resume["peer_rank"], resume["world_size"],
            resume["saved_world_size"]) == (PARK, "memory", None, 1, 2)
    assert not events(ev, "snapshot.memory_received")  # A held the whole step
    assert [e for e in events(ev, "snapshot.loaded") if e["tier"] == "durable"] == []
    assert [e["final_step"] for e in events(ev / "a", "run.finished")] == [30]


@pytest.mark.timeout(900)
def test_two_workers_a_node_restore_sharded_state_from_the_buddy(
        tmp_path: Path, agents: Agents) -> None:
    """Two workers a node (world size 4, each rank one quarter of the shards): node A
    holds its own ranks' parts and, as B's buddy, B's. A replacement B' resumes step 25
    with all four parts from A; the result is bit-exact with an uninterrupted run of
    four workers on one agent."""
    started = Agents(tmp_path / "reference")
    try:
        ref = started.start("ref", tmp_path / "ref", tmp_path / "mem-ref", nproc=4,
                            extra=(FSDP,))
        assert ref.wait(timeout=600) == 0, _log(started)
        reference = _digest(tmp_path / "reference" / "ev" / "ref")
    finally:
        started.stop_all()
    node_a, node_b, common = _two_nodes(agents, tmp_path, "2", extra=(FSDP, f"--park={PARK}"),
                                        nproc=2)
    pids = _wait_parked(tmp_path / "gates", 4)
    # Node leaders commit; every rank reports its parts replicated to the buddy.
    wait_for(lambda: len({e["rank"] for e in events(tmp_path / "ev", "snapshot.memory_replicated")
                          if e["snapshot_step"] == PARK}) == 4, 60,
             "both nodes' memory snapshots of step 25 replicated")
    for mem in (tmp_path / "mem-a", tmp_path / "mem-b"):
        assert _held_here(mem, PARK) == (True, 4)  # its own two parts and its buddy's two
        # Parts written and parts received alike are the user's alone.
        loose = {str(p): oct(stat.S_IMODE(st.st_mode)) for p, st in stats_under(mem).items()
                 if stat.S_IMODE(st.st_mode) != (0o700 if stat.S_ISDIR(st.st_mode) else 0o600)}
        assert not loose, loose
    _kill_node(node_b, [pids[2], pids[3]], tmp_path / "mem-b")
    (tmp_path / "gates" / "go").write_text("")
    node_b2 = agents.start("b2", tmp_path / "run", tmp_path / "mem-b2", is_host=0, **common)
    assert node_a.wait(timeout=600) == 0, _log(agents)
    assert node_b2.wait(timeout=60) == 0, _log(agents)

    ev = tmp_path / "ev"
    on_a = {r: _last_resume(ev / "a", r) for r in _last_ranks(ev / "a")}
    on_b2 = {r: _last_resume(ev / "b2", r) for r in _last_ranks(ev / "b2")}
    assert len(on_a) == len(on_b2) == 2
    assert {(e["from_step"], e["tier"], e["peer_rank"]) for e in on_a.values()} == \
        {(PARK, "memory", None)}
    assert {(e["from_step"], e["tier"]) for e in on_b2.values()} == {(PARK, "memory")}
    assert {e["peer_rank"] for e in on_b2.values()} <= set(on_a)  # from node A
    assert [e for e in events(ev, "snapshot.loaded") if e["tier"] == "durable"] == []
    assert _digest(ev) == reference  # bit-exact

