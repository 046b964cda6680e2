"""``elastictrain snapshots list|verify`` through the real CLI (a subprocess): nothing
to list or verify is one line on stderr, and ``verify`` exits 1 (issue 9, case 13)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastictrain.storage import open_store
from tests.helpers import run_cli
from tests.planted import plant_snapshot


@pytest.mark.parametrize("where", ["empty", "missing"])
def test_verify_and_list_say_when_there_are_no_snapshots(tmp_path: Path, where: str) -> None:
    root = tmp_path / "run"
    if where == "empty":
        (root / "snapshots").mkdir(parents=True)
    verify = run_cli(["snapshots", "verify", str(root)], tmp_path)
    assert verify.returncode == 1 and verify.stdout == ""
    lines = verify.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"no snapshots under {root}; fix: "), lines
    listed = run_cli(["snapshots", "list", str(root)], tmp_path)
    assert listed.returncode == 0 and listed.stdout == ""
    assert listed.stderr.strip() == lines[0]
    assert not root.exists() or where == "empty"  # looking never creates the directory


def test_verify_exits_0_when_every_snapshot_verifies_and_1_for_a_missing_step(
        tmp_path: Path) -> None:
    root = tmp_path / "run"
    plant_snapshot(open_store(str(root)), 5, {"w": torch.ones(4)})
    ok = run_cli(["snapshots", "verify", str(root)], tmp_path)
    assert ok.returncode == 0 and "step=5  status=ok" in ok.stdout, ok.stderr
    missing = run_cli(["snapshots", "verify", str(root), "--step", "7"], tmp_path)
    assert missing.returncode == 1
    assert missing.stderr.strip().startswith(f"no snapshot of step 7 under {root}; fix: ")


def test_verify_help_states_the_exit_codes(tmp_path: Path) -> None:
    helped = run_cli(["snapshots", "--help"], tmp_path)
    assert "exit 1 if any is corrupt or none is found" in " ".join(helped.stdout.split())
