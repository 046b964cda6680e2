"""scripts/bench_snapshot.py end to end at a tiny size: every figure the issue names is
in its --json (restore on 1 and 2 ranks, cold and warm, peak RSS during restore, the
first save), and --from-json re-prints and plots earlier runs without measuring."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.bench

ROOT = REPO
BENCH = ROOT / "scripts" / "bench_snapshot.py"


def _bench(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=240, check=False)


def test_a_tiny_run_reports_every_figure_and_replays_from_json(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    done = _bench("--sizes", "4", "--saves", "1", "--runs", "1", "--restore-reps", "1",
                  "--staging-saves", "2",
                  "--staging-size-mb", "1", "--skip-dcp", "--paced-mb-s", "500",
                  "--dir", str(tmp_path),
                  "--json", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    (point,) = report["points"]
    assert report["sizes_mb"] == [4.0]
    for key in ("restore_vs_raw_read", "restore_vs_raw_read_warm", "restore_vs_raw_read_1rank",
                "restore_vs_raw_read_1rank_warm", "restore_peak_rss_over_state",
                "blocking_ratio_vs_sync"):
        assert point[key] > 0, key
        assert point["targets"][key]["met"] in (True, False)
    assert {"restore_each_cold", "restore_each_warm", "raw_read_cold",
            "raw_read_warm"} <= point["restore_1rank_s"].keys()
    assert {"restore_each_cold", "restore_broadcast_warm"} <= point["restore_s"].keys()
    names = [m["name"] for m in point["methods"]]
    assert not any(n.startswith("dcp") for n in names)  # --skip-dcp
    assert all(m["first_blocking_s"] > 0 for m in point["methods"])
    assert "elastictrain async (thread), paced 500 MB/s" in names
    assert point["paced_runs"]["persist_max_mb_s"] == 500
    assert len(point["paced_runs"]["durable_s"]) == 1
    assert "step_rate_ratio_during_persist_paced" in point["targets"]
    assert point["setup"]["step_rate_ratio_with_memory_copy"] > 0
    assert len(point["runs"]["step_rate_ratio_with_memory_copy"]) == 1
    assert "a process copying half the state" in done.stdout
    # The table is printed too, with the 1-rank restore line.
    assert "restore (1 rank)" in done.stdout

    plot = tmp_path / "curve.png"
    replay = _bench("--from-json", str(out), str(out), "--plot", str(plot), cwd=tmp_path)
    assert replay.returncode == 0, replay.stderr[-3000:]
    assert replay.stdout.count("restore (1 rank)") == 2  # both files' points, not re-measured
    pytest.importorskip("matplotlib")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
