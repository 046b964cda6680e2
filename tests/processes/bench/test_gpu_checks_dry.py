"""``scripts/gpu_checks.py --dry``: the GPU checks' own logic, on CPU with gloo, so the
command stays correct where CI has no GPU (its GPU figures: docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, child_env

pytestmark = [pytest.mark.bench, pytest.mark.distributed]


@pytest.mark.timeout(900)  # nine launches of a 2-worker job, on two busy cores
def test_every_gpu_check_passes_in_dry_mode(tmp_path: Path) -> None:
    out = tmp_path / "checks.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_checks.py"), "--dry",
                    f"--out={out}"], cwd=tmp_path, capture_output=True, timeout=840,
                   check=False, env=child_env(tmp_path))  # its work directory: in tmp_path
    report = json.loads(out.read_text())
    assert report["dry"] is True and report["device"] == "cpu"
    checks = report["checks"]
    assert set(checks) == {"snapshot", "ddp_restart", "fsdp2_restart", "notice_during_save",
                           "sense_check", "cuda_stall"}
    failed = {name: c for name, c in checks.items() if not c["ok"]}
    assert not failed, failed
    assert checks["snapshot"]["params_equal"] and checks["snapshot"]["optimizer_equal"]
    assert checks["ddp_restart"]["attempts_started_by"] == ["standby", "standby"]
    assert 71 in checks["cuda_stall"]["worker_exit_codes"]  # the agent may stop the other first
    assert checks["notice_during_save"]["save_in_flight_at_notice"] is True
    assert checks["sense_check"]["suspect_steps"] == [20]
    assert checks["sense_check"]["resumed_from"] == 10
