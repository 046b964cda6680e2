"""``elastictrain snapshots list|verify`` through the real CLI (a subprocess): nothing
to list or verify is one line on stderr, and ``verify`` exits 1; a run root that is not
there, or a step that is not, is bad input (2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastictrain.storage import open_store
from tests.helpers import run_cli
from tests.planted import plant_snapshot

pytestmark = pytest.mark.processes


def test_verify_and_list_say_when_there_are_no_snapshots(tmp_path: Path) -> None:
    root = tmp_path / "run"
    (root / "snapshots").mkdir(parents=True)
    verify = run_cli(["snapshots", "verify", str(root)], tmp_path)
    assert verify.returncode == 1 and verify.stdout == ""
    lines = verify.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"no snapshots under {root}; fix: "), lines
    listed = run_cli(["snapshots", "list", str(root)], tmp_path)
    assert listed.returncode == 0 and listed.stdout == ""
    assert listed.stderr.strip() == lines[0]


def test_a_missing_run_root_is_bad_input_and_never_created(tmp_path: Path) -> None:
    root = tmp_path / "run"
    for action in ("list", "verify"):
        result = run_cli(["snapshots", action, str(root)], tmp_path)
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.strip() == (f"elastictrain: error: storage root {root}: no such "
                                          "directory; fix: check the path (the --storage of "
                                          "demo or run, which holds snapshots/ and events/)")
    assert not root.exists()  # looking never creates the directory


def test_verify_exits_0_when_every_snapshot_verifies_and_2_for_a_missing_step(
        tmp_path: Path) -> None:
    root = tmp_path / "run"
    plant_snapshot(open_store(str(root)), 5, {"w": torch.ones(4)})
    ok = run_cli(["snapshots", "verify", str(root)], tmp_path)
    assert ok.returncode == 0 and "step=5  status=ok" in ok.stdout, ok.stderr
    missing = run_cli(["snapshots", "verify", str(root), "--step", "7"], tmp_path)
    assert missing.returncode == 2  # a step that is not there: a bad argument
    assert missing.stderr.strip() == (f"elastictrain: error: no snapshot of step 7 under "
                                      f"{root}; steps there, newest first: 5; fix: pass one "
                                      "of them with --step")


def test_verify_help_states_the_exit_codes(tmp_path: Path) -> None:
    helped = run_cli(["snapshots", "--help"], tmp_path)
    assert "exit 1 if any is corrupt or none verifies" in " ".join(helped.stdout.split())
