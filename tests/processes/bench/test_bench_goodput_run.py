"""scripts/bench_goodput.py end to end at a tiny scale: one fixed interval, 20 s of
training under seeded SIGKILLs (MTBF 8 s); the JSON report has every figure, they agree
with each other, and no worker is left behind."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, child_env

pytestmark = [pytest.mark.bench, pytest.mark.distributed, pytest.mark.timeout(150)]


def test_tiny_goodput_bench_reports_every_field(tmp_path: Path) -> None:
    cmd = [sys.executable, str(REPO / "scripts" / "bench_goodput.py"), "--wall-s=20",
           "--mtbf-s=8", "--seed=5", "--configs", "fixed:10", "--json", "-",
           f"--workdir={tmp_path}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=140,
                            env=child_env(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout)
    assert report["bench"] == "goodput" and report["seeds"] == [5]
    assert report["runs"][0]["schedule"] == [{"at_s": 7.802, "rank": 1, "node": False}]
    assert isinstance(report["noisy"], bool) and report["load_avg_before"] >= 0
    (run,) = report["results"]
    assert run["config"] == "fixed:10" and run["kills"] == 1
    assert 0 < run["goodput"] == run["fractions"]["productive"] < 1
    assert sum(run["fractions"].values()) == pytest.approx(1.0, abs=0.002)
    assert run["cost"]["snapshots"] >= 1 and run["cost"]["by_tier"].keys() == {"durable"}
    assert run["ratio_to_best_fixed"] == 1.0  # the only fixed interval is the best one
    assert run["interval_loss"] == pytest.approx(
        run["fractions"]["lost_work"] + run["fractions"]["snapshot_blocking"], abs=1e-4)
    assert run["best_fixed_interval_loss"] == run["interval_loss"]
    (kill,) = run["recoveries"]
    if kill["recovery_s"] is not None:  # the restart trained before the stop (usually)
        assert run["recovery_s"] == kill["recovery_s"] > 0
        mtbf = run["mtbf_realised_s"]
        assert mtbf == pytest.approx(run["wall_s"])  # one kill
        assert run["bound"] == pytest.approx(
            1 - math.sqrt(2 * run["cost"]["mean_s"] / mtbf) - run["recovery_s"] / mtbf)
        assert run["ratio_to_bound"] == pytest.approx(run["goodput"] / run["bound"])
    # Every process it started is gone (their command lines name this tmp_path).
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        assert str(tmp_path).encode() not in cmdline, cmdline
