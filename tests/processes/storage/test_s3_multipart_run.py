"""S3 uploads in a child process hold no copy of the state: multipart and one PUT."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, child_env
from tests.s3server import S3Bucket
from tests.unit.storage.test_s3_multipart import MIB

pytestmark = pytest.mark.s3
def _memory_probe(s3: S3Bucket, tmp_path: Path, state_mb: int, part_mb: int,
                  concurrency: int) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.processes.storage.memory_probe", s3.server.endpoint, s3.name,
         str(state_mb), str(part_mb), str(concurrency)],
        capture_output=True, text=True, timeout=240, cwd=REPO,
        env=child_env(tmp_path, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["state_bytes"] >= state_mb * MIB
    assert out["buffered_peak_bytes"] >= 0.9 * out["state_bytes"], out  # the probe works
    return out


@pytest.mark.processes
def test_multipart_persist_holds_no_copy_of_the_state(s3: S3Bucket, tmp_path: Path) -> None:
    """Persisting a 48 MB state as a multipart upload sends the parts from the state's
    own memory: Python memory stays under a tenth of the state (headers, the pickle,
    clients), where s3fs's buffered writer on the same bytes holds a full copy."""
    state_mb, part_mb, concurrency = 48, 5, 2
    out = _memory_probe(s3, tmp_path, state_mb, part_mb, concurrency)
    assert out["peak_bytes"] <= 0.1 * out["state_bytes"], out
    assert out["etag"].endswith(f'-{-(-out["state_bytes"] // (part_mb * MIB))}"')


@pytest.mark.processes
def test_one_put_holds_no_copy_of_the_state(s3: S3Bucket, tmp_path: Path) -> None:
    """A state below the multipart threshold goes up in one PUT, its body views of the
    state's memory: no copy by elastictrain nor by the HTTP client."""
    out = _memory_probe(s3, tmp_path, state_mb=48, part_mb=64, concurrency=2)
    assert out["etag"].count("-") == 0  # one PUT, not a multipart upload
    assert out["peak_bytes"] <= 0.1 * out["state_bytes"], out


