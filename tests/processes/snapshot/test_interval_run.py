"""The automatic interval against the best fixed one in hindsight, by
scripts/simulate_interval.py run as a child process: within five percent."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.processes
def test_simulation_auto_within_five_percent_of_the_best_fixed_interval() -> None:
    """scripts/simulate_interval.py, small and seeded: the manager's own policy against
    a grid of fixed intervals chosen in hindsight on the same failure traces."""
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "simulate_interval.py"), "--mtbf", "120",
         "600", "--dist", "exponential", "weibull", "--trials", "5", "--seed", "0",
         "--json"], capture_output=True, text=True, timeout=300, check=True)
    out = json.loads(result.stdout)
    assert len(out["rows"]) == 4 and all(r["failures"] > 50 for r in out["rows"])
    assert out["worst_ratio"] <= 1.05, out


