"""``elastictrain chaos --faults node`` end to end: the demo on two agents, each with its
own memory directory, a clean run, then two seeded trials that each lose a whole node
(every process of one agent SIGKILLed by PID, its memory wiped) and pass the checks:
every other launcher exits 0, each sample trained once, each resume from the newest
complete copy within its lost-step bound, the clean run's digest at full size, nothing
left running. The checks themselves, on made-up events: test_node_checks.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.chaos.test_chaos_e2e import processes_mentioning
from tests.helpers import run_cli

pytestmark = pytest.mark.distributed  # several agents under elastictrain run


@pytest.mark.timeout(500)
def test_chaos_two_node_losses_on_the_demo_pass(tmp_path: Path) -> None:
    work = tmp_path / "chaos"
    result = run_cli(["chaos", "--faults", "node", "--nodes", "2", "--nproc", "1",
                      "--trials", "2", "--seed", "13", "--steps", "30", "--storage", str(work),
                      "--json"], tmp_path, timeout=480)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["passed"] and report["clean_digest"]
    first, second = report["trials"]
    # Seed 13: node0 lost at once at step 13 and not replaced (the job goes on one node
    # smaller); node1 frozen (silent) at step 21, killed, and replaced.
    assert first["injected"][0].startswith("node: SIGSTOP node0.0"), first
    assert "at once" in first["injected"][0] and len(first["injected"]) == 1
    assert second["injected"][0].startswith("node: SIGSTOP node1.0"), second
    assert "held" in second["injected"][0]
    assert second["injected"][1] == "replaced: node1.1 started"
    assert first["restarts"] >= 1 and second["restarts"] >= 1
    assert report["by_kind"]["node"] == {"trials": 2, "passed": 2}
    assert "chaos-secret-" not in result.stdout + result.stderr
    assert processes_mentioning(work) == []
