"""Two torchrun agents on one machine (c10d on 127.0.0.1, --nnodes 1:2, one worker
each): a node failure shrinks the job to world size 1, a new agent grows it back
to 2, all inside one epoch, and no sample is lost or trained twice.

The real `elastictrain demo` CLI: the runner SIGKILLs the second agent's process
group and its worker by PID after step 6; the survivor resumes from snapshot 4 at
size 1 (steps 5 and 6 are redone, with other samples, and replace the lost execution);
after step 10 a new agent joins: the survivor's agent asks its worker for a snapshot of
the step it is at (step 11, its next), and the job resumes from it at size 2, redoing
no step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.accounting import assert_each_sample_once, kill_leftovers, surviving_steps
from tests.helpers import events, run_demo_json

pytestmark = pytest.mark.distributed

N = 97


@pytest.fixture
def events_root(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "ev"
    yield root
    kill_leftovers(root)  # only matters when the demo failed or timed out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.timeout(480)  # above the demo's own 420 s limit
def test_node_killed_and_replaced_inside_an_epoch(tmp_path: Path, events_root: Path) -> None:
    out = run_demo_json(tmp_path, f"--storage={tmp_path / 's'}", "--nnodes=1:2", "--nproc=1",
                        f"--samples={N}", "--batch-size=4", "--steps=18",
                        "--snapshot-every=4", "--kill-node-at=6", "--add-node-at=10",
                        f"--record-samples={tmp_path / 'rec'}", f"--events-dir={events_root}",
                        timeout=420)
    assert out["final_step"] == 18
    # A slow agent can miss the first round's last call: the job then starts at size 1
    # and grows before training far; the kill, shrink and grow are the last three.
    assert out["world_sizes"][-3:] == [2, 1, 2], out
    assert out["resumed_from"][-2:] == [4, 11], out  # 11: saved before the restart
    killed, added = out["membership"]
    assert (killed["change"], killed["node"], killed["world_size"]) == ("node_killed", 1, 1)
    assert (added["change"], added["node"], added["world_size"]) == ("node_added", 2, 2)
    assert killed["seconds_to_first_step"] > 0 and added["seconds_to_first_step"] > 0

    run_dir = Path(out["events_dir"])
    (marker,) = (run_dir / "gates" / "kill").glob("rank*.json")
    victim_worker = json.loads(marker.read_text())["pid"]
    victim_agent = int((run_dir / "node1" / "agent.pid").read_text())
    assert not alive(victim_worker) and not alive(victim_agent)
    # Every worker of every attempt has exited: nothing left running.
    assert not [e["pid"] for e in events(run_dir, "worker.start") if alive(int(e["pid"]))]
    resumes = [e for e in events(run_dir, "resume") if e["rank"] == 0]
    shrink, grow = sorted(resumes, key=lambda e: e["ts"])[-2:]
    assert (shrink["saved_global_batch"], shrink["global_batch"]) == (8, 4)
    assert (grow["saved_global_batch"], grow["global_batch"]) == (4, 8)

    steps = surviving_steps(tmp_path / "rec")
    assert [steps[s].world_size for s in (4, 5, 11, 12, 18)] == [2, 1, 1, 2, 2]
    worlds = {s: {e["world"] for e in events(tmp_path / "rec") if e["step"] == s}
              for s in (5, 12)}
    assert len(worlds[5]) == 2  # lost with the node, redone at size 1
    assert worlds[12] == {steps[18].world}  # the join redid nothing
    # Epoch 0: 32 at size 2, 28 at size 1, then 37 at size 2 (four steps of 8 and a
    # tail of 5, padded to 6 with the epoch's first sample).
    assert assert_each_sample_once(steps, N, seed=0, final_step=18) == {0: 1}
    assert [len(steps[s].samples) for s in (15, 16, 17)] == [8, 6, 8]
