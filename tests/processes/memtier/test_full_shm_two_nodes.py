"""The memory tier on a node whose memory directory is a real 8 MiB
tmpfs that is full, under two real ``elastictrain run`` agents (two nodes, one worker
each, gloo on CPU).

* Full from the start: node B's memory directory cannot hold a byte; B says so once
  and durable snapshots go on. With FSDP the sharded tier is off on both nodes (every
  memory save is a collective); with DDP (also run here) node A's memory snapshots go
  on. Node B is then lost without notice and replaced: the job resumes, from durable
  step 20 (FSDP) or from A's memory (DDP), and ends bit-exact with a clean run.
* Filled while the job runs (the workers parked after step 25): the next memory
  saves fail on node B, nothing hangs, training goes on and ends bit-exact.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elastictrain.snapshot.format.reader import list_snapshot_dirs
from elastictrain.storage import open_store
from tests.helpers import events, wait_for
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
from tests.processes.memtier.test_node_full_shm import fill, small_tmpfs
from tests.processes.memtier.test_peer_e2e import _from_peer, _kill_node, _resumes, _two_nodes
from tests.processes.memtier.test_sharded_peer_e2e import FSDP

pytestmark = [pytest.mark.distributed, pytest.mark.processes,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small tmpfs")]
__all__ = ["agents", "small_tmpfs"]  # fixtures, used by name


def _degraded(ev: Path) -> set[str]:
    return {e["what"] for e in events(ev, "snapshot.memory_degraded")}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("sharded", [True, False], ids=["fsdp", "ddp"])
def test_full_from_the_start_and_a_lost_node(tmp_path: Path, agents: Agents,
                                             fsdp_reference: str, reference_digest: str,
                                             small_tmpfs: Path, sharded: bool) -> None:
    """With DDP, node A's memory snapshots go on (they hold every rank's state) and
    the replacement receives step 25 from A; with FSDP the tier is off everywhere and
    the job resumes durable step 20."""
    fill(small_tmpfs)
    node_a, node_b, common = _two_nodes(agents, tmp_path, "2",
                                        ((FSDP,) if sharded else ()) + (f"--park={PARK}",),
                                        mem_b=small_tmpfs / "mem")
    pids = _wait_parked(tmp_path / "gates", 2)
    ev = tmp_path / "ev"
    wait_for(lambda: list_snapshot_dirs(open_store(str(tmp_path / "run"))) == [EVERY], 60,
             "the durable snapshot of step 20")
    assert "memory directory" in _degraded(ev / "b")
    memory_commits = [e for e in events(ev, "snapshot.committed") if e.get("tier") == "memory"]
    if sharded:  # the tier is off on both nodes
        assert memory_commits == []
    else:
        wait_for(lambda: _memory_committed(ev / "a", PARK, 1), 60, "A's memory snapshot")
    _kill_node(node_b, [pids[1]], small_tmpfs / "mem")
    (tmp_path / "gates" / "go").write_text("")
    node_b2 = agents.start("b2", tmp_path / "run", tmp_path / "mem-b2", is_host=0, **common)
    assert node_a.wait(timeout=600) == 0, _log(agents)
    assert node_b2.wait(timeout=60) == 0, _log(agents)
    if sharded:
        assert _resumes(ev) == [(0, EVERY, "durable", None), (1, EVERY, "durable", None)]
        assert _digest(ev) == fsdp_reference
    else:
        assert _resumes(ev) == _from_peer(ev, "a", "b2")
        assert _digest(ev) == reference_digest


@pytest.mark.timeout(900)
def test_filled_while_running_fails_memory_saves_and_training_goes_on(
        tmp_path: Path, agents: Agents, fsdp_reference: str, small_tmpfs: Path) -> None:
    node_a, node_b, _ = _two_nodes(agents, tmp_path, "2", (FSDP, f"--park={PARK}"),
                                   mem_b=small_tmpfs / "mem")
    _wait_parked(tmp_path / "gates", 2)
    ev = tmp_path / "ev"
    wait_for(lambda: len({e["rank"] for e in events(ev, "snapshot.memory_replicated")
                          if e["snapshot_step"] == PARK}) == 2, 60,
             "step 25's memory snapshot replicated")
    fill(small_tmpfs)
    (tmp_path / "gates" / "go").write_text("")
    assert node_a.wait(timeout=600) == 0, _log(agents)
    assert node_b.wait(timeout=60) == 0, _log(agents)
    assert _digest(ev) == fsdp_reference
    assert "memory snapshot" in _degraded(ev / "b")
    assert [e for e in events(ev, "run.finished")]
