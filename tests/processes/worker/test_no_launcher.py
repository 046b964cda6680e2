"""A script run without a launcher (``python train.py``): ``init()`` says it runs alone
and which command to use instead; a bad setting read there is one line and exit 78
(the code for "do not retry"), not a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from elastictrain.core.errors import EXIT_FATAL
from tests.helpers import REPO, child_env

pytestmark = pytest.mark.processes

SCRIPT = "import elastictrain as et\net.init()\nprint('initialised')\n"


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    environ = child_env(tmp_path, PYTHONPATH=str(REPO), **env)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID"):
        environ.pop(name, None)
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=environ,
                          capture_output=True, text=True, timeout=120, check=False)


def test_a_script_without_a_launcher_is_told_to_use_one(tmp_path: Path) -> None:
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout + done.stderr
    assert "worker.no_launcher" in out and "elastictrain run --nproc-per-node" in out
    assert "initialised" in done.stdout


def test_a_bad_setting_without_a_launcher_is_one_line_and_exit_78(tmp_path: Path) -> None:
    done = _run(tmp_path, ELASTICTRAIN_SNAPSHOTS__KEEP="5")
    assert done.returncode == EXIT_FATAL, done.stdout + done.stderr
    out = done.stdout + done.stderr
    assert "Traceback" not in out
    assert "ELASTICTRAIN_SNAPSHOTS__KEEP" in out and "ELASTICTRAIN_SNAPSHOT__KEEP" in out
