"""scripts/bench_replica_check.py end to end at its smallest size: one process, its
JSON figures present and sane (the hash finite and positive, the ratio to the restore
that precedes it computed from the same rounds)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.bench


def test_tiny_run_reports_the_hash_against_the_restore() -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_replica_check.py"),
                           "--sizes", "8", "--rounds", "2", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    (size,) = json.loads(done.stdout)["sizes"]
    assert size["digest_s"] > 0 and size["restore_s"] > 0
    assert size["digest_vs_restore_range"][0] <= size["digest_vs_restore"] \
        <= size["digest_vs_restore_range"][1]
