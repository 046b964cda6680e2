"""A restore from S3 (moto's server) holds about one copy of the state, measured in a
child process."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, child_env
from tests.planted import plant_snapshot
from tests.s3server import S3Bucket
from tests.unit.storage.test_restore_s3 import s3_store

pytestmark = pytest.mark.s3
MIB = 2**20
def probe(s3: S3Bucket, tmp_path: Path, how: str) -> dict[str, int]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.processes.storage.restore_memory_probe", s3.server.endpoint,
         s3.url(), how], capture_output=True, text=True, timeout=240, cwd=REPO,
        env=child_env(tmp_path, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.processes
def test_restore_holds_about_one_copy_of_the_state(s3: S3Bucket, tmp_path: Path) -> None:
    """48 MB on S3: restore's peak RSS growth is at most 1.2x the state plus a bounded
    buffer (reads of 8 MiB through a 1 MiB read-ahead: about 24 MB at any size);
    reading the whole object, then deserializing it (the old way, measured alongside)
    holds two copies."""
    state = {f"w{i}": torch.randn(48 * MIB // 4 // 8) for i in range(8)}
    plant_snapshot(s3_store(s3), 1, state)
    ours, whole = probe(s3, tmp_path, "restore"), probe(s3, tmp_path, "whole")
    size = ours["state_bytes"]
    print(f"restore peak/state {ours['peak_growth_bytes'] / size:.2f}, "
          f"read-whole-then-load {whole['peak_growth_bytes'] / size:.2f}")
    assert ours["peak_growth_bytes"] <= 1.2 * size + 32 * MIB, ours
    assert whole["peak_growth_bytes"] >= 1.9 * size, whole  # the probe sees a second copy


