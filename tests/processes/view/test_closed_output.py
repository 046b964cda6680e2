"""A reader that closes the output early (``elastictrain snapshots list … | head``)
ends the command quietly, as SIGPIPE ends other command-line tools: exit 141, no
traceback. The reader here is gone before the command starts (a pipe with no read
end), so every command meets it on its first write."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastictrain.core.errors import EXIT_READER_GONE
from tests.helpers import child_env
from tests.small_job import build, train

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("closed") / "run"
    parts = build(str(root))
    train(*parts, until=10)
    parts[4].close()
    return root


@pytest.mark.parametrize("command", [["snapshots", "list"], ["snapshots", "verify"],
                                     ["snapshots", "list", "--json"], ["status"]])
def test_a_closed_output_ends_the_command_quietly(run_dir: Path, tmp_path: Path,
                                                  command: list[str]) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-m", "elastictrain.cli", *command,
                                 str(run_dir)], stdout=write_end, stderr=subprocess.PIPE,
                                text=True, timeout=120, env=child_env(tmp_path), check=False)
    finally:
        os.close(write_end)
    assert result.returncode == EXIT_READER_GONE == 128 + 13, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr
