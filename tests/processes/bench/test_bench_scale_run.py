"""scripts/bench_scale.py end to end at its smallest world size (two agents of one worker):
every figure it reports is in its --json, the storage operations are counted per rank on
local disk and on S3, and no rank but the writer receives the RNG states."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.bench

ROOT = REPO
BENCH = ROOT / "scripts" / "bench_scale.py"


def test_a_two_rank_run_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    done = subprocess.run([sys.executable, str(BENCH), "--sizes", "2", "--quick",
                           "--dir", str(tmp_path), "--json", str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    assert result["world_size"] == 2 and result["exit_codes"] == [75, 75]
    recovery = result["recovery"]
    for key in ("total_s", "agent_rendezvous_s", "process_group_init_s",
                "restore_agreement_s", "load_s"):
        assert recovery[key] >= 0, key
    assert recovery["from_step"] > 0
    assert result["preemption"]["notice_to_committed_s"] > 0
    saves = result["saves"]
    for kind in ("replicated", "sharded"):
        for where in ("local", "s3"):
            save = saves[f"save_{kind}_{where}"]
            assert save["ops_total"]["PUT"] >= 2 and save["durable_s"] > 0
            assert saves[f"restore_{kind}_{where}"]["ops_total"]["GET"] >= 1
    # Both ranks write a part of a sharded snapshot; only the writer commits it.
    assert saves["save_sharded_s3"]["ops_other_rank_max"] == {"PUT": 1}
    # The RNG states reach the writer only.
    assert saves["save_replicated_local"]["gathered_bytes_rank0"] > 0
    assert saves["save_replicated_local"]["gathered_bytes_other_max"] == 0
    assert result["events_per_attempt"]["attempt1"]["worker_files"] >= 2
    assert result["memory"]["pss_mb_total"] > 0
