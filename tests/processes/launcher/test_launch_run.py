"""``elastictrain run`` as a child process, without workers: usage errors exit 2 with one
clear line, bad settings are fatal (78)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_cli


@pytest.mark.processes
def test_usage_errors_exit_2_with_one_clear_line(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    result = run_cli(["run", "--nnodes=1:2", "train.py"], tmp_path, timeout=120)
    assert result.returncode == 2
    assert "--rdzv-endpoint" in result.stderr and "fix" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_cli(["run", "--no-such-option", "train.py"], tmp_path, timeout=120)
    assert result.returncode == 2 and "elastictrain run" in result.stderr


@pytest.mark.processes
def test_bad_settings_are_fatal_78(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    result = run_cli(["run", "train.py"], tmp_path, timeout=120,
                     ELASTICTRAIN_LAUNCH__SHUTDOWN_TIMEOUT_S="0")
    assert result.returncode == 78
    assert "launch.shutdown_timeout_s" in result.stderr and "Traceback" not in result.stderr


