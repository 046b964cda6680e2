"""scripts/bench_shard_sum.py end to end at its smallest size: both variants run, every
figure is in its --json, and --table replays the report as the docs show it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.bench

BENCH = REPO / "scripts" / "bench_shard_sum.py"


def test_a_tiny_run_reports_both_variants_and_replays(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    done = subprocess.run([sys.executable, str(BENCH), "--ranks", "2", "--rounds", "1",
                           "--steps", "1", "--width", "16", "--layers", "1",
                           "--global-batch", "8", "--shards", "4", "--json", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert row["ranks"] == 2 and row["ddp_step_s"] > 0 and row["shards_step_s"] > 0
    assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
    table = subprocess.run([sys.executable, str(BENCH), "--table", str(out)], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120, check=True).stdout
    assert table.splitlines()[2].startswith("| 2 | ")
