"""The cheap commands the docs show, run for real: ``--help`` of every command and
``snapshots list`` / ``status`` on an empty run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_cli


@pytest.mark.processes
@pytest.mark.parametrize("args", [["--help"], ["status", "--help"], ["demo", "--help"]])
def test_help_runs_and_has_no_internal_markup(args: list[str], tmp_path: Path) -> None:
    result = run_cli(args, tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage: elastictrain" in result.stdout
    assert "``" not in result.stdout


@pytest.mark.processes
def test_snapshots_list_and_status_run_on_an_empty_run(tmp_path: Path) -> None:
    listed = run_cli(["snapshots", "list", str(tmp_path), "--json"], tmp_path, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == []
    status = run_cli(["status", str(tmp_path)], tmp_path, timeout=60)
    assert status.returncode == 2 and "no events and no snapshots" in status.stderr


