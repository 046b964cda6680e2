"""``elastictrain chaos --faults node`` end to end: the demo on two agents, each with its
own memory directory, a clean run, then two seeded trials that each lose a whole node
(every process of one agent SIGKILLed by PID, its memory wiped; with ``join``, a node
not replaced comes back while the smaller job trains) and pass the checks:
every other launcher exits 0, each sample trained once, each resume from the newest
complete copy within its lost-step bound, the clean run's digest at full size, nothing
left running. The same on the README's example script, its steps read from its
train.progress events. The checks themselves, on made-up events: test_node_checks.py,
test_step_marks.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import REPO, run_cli
from tests.processes.chaos.test_chaos_e2e import processes_mentioning

pytestmark = pytest.mark.distributed  # several agents under elastictrain run


@pytest.mark.timeout(500)
def test_chaos_two_node_losses_on_the_demo_pass(tmp_path: Path) -> None:
    work = tmp_path / "chaos"
    result = run_cli(["chaos", "--faults", "node,join", "--nodes", "2", "--nproc", "1",
                      "--trials", "2", "--seed", "13", "--steps", "30", "--storage", str(work),
                      "--json"], tmp_path, timeout=480)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["passed"] and report["clean_digest"]
    first, second = report["trials"]
    # Seed 13: node0 lost at once at step 13 and not replaced (the job goes on one node
    # smaller), then back once the smaller job trained a step (a join while it trains,
    # or, where the survivor finished first, a node that finds the job done: either
    # way a trial that must pass); node1 frozen (silent) at step 21, killed, replaced.
    assert first["injected"][0].startswith("node: SIGSTOP node0.0"), first
    assert "at once" in first["injected"][0] and len(first["injected"]) == 2
    assert first["injected"][1].startswith("rejoined: node0.1 started"), first
    assert second["injected"][0].startswith("node: SIGSTOP node1.0"), second
    assert "held" in second["injected"][0]
    assert second["injected"][1] == "replaced: node1.1 started"
    assert first["restarts"] >= 1 and second["restarts"] >= 1
    assert report["by_kind"]["node"] == {"trials": 2, "passed": 2}
    assert "chaos-secret-" not in result.stdout + result.stderr
    assert processes_mentioning(work) == []


@pytest.mark.timeout(300)
def test_chaos_a_node_lost_and_replaced_on_a_script_passes(tmp_path: Path) -> None:
    """examples/ddp_resumable.py, unmodified (48 steps at world size 2, a durable
    snapshot every 10): no sample records, so no exactly-once check; every other check
    runs on its events, the digest included (the node is replaced: full size again).
    Losses that shrink the job run on the demo above (same harness)."""
    work = tmp_path / "chaos"
    script = str(REPO / "examples" / "ddp_resumable.py")
    result = run_cli(["chaos", "--faults", "node", "--nodes", "2", "--nproc", "1",
                      "--first", "1", "--trials", "1", "--seed", "12", "--storage", str(work),
                      "--json", "--", script, "{storage}"], tmp_path, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["passed"] and report["clean_digest"]
    assert report["interval"] == 10  # the script's own durable interval, from its clean run
    assert "memory every 3, durable every 10 steps" in result.stderr
    (trial,) = report["trials"]
    # Seed 12, trial 1 (48 steps): node0 lost at once at step 27 and replaced.
    assert trial["injected"][0].startswith("node: SIGSTOP node0.0 after step 27"), trial
    assert trial["injected"][1] == "replaced: node0.1 started"
    assert trial["failures"] == [] and trial["restarts"] >= 1, trial
    assert trial["exit_codes"][0] == -9 and trial["exit_codes"][1:] == [0] * (
        len(trial["exit_codes"]) - 1), trial
    assert report["by_kind"]["node"] == {"trials": 1, "passed": 1}
    assert "chaos-secret-" not in result.stdout + result.stderr
    assert processes_mentioning(work) == []
