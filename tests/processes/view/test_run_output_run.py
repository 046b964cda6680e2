"""``elastictrain run``'s output as a child process: to a file with its children, the
terminal given back; ``--no-view`` in the help."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastictrain.view.run import output_to


@pytest.mark.processes
def test_output_to_a_file_takes_children_too_and_gives_the_terminal_back(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "launcher.log"
    with output_to(log) as terminal:
        os.write(1, b"from the launcher\n")  # torchrun's log, structlog: descriptor 1 and 2
        subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('from a worker')"],
                       check=True)
        terminal.write("the view\n")
    print("after")
    out, err = capfd.readouterr()
    assert out == "the view\nafter\n" and err == ""
    assert log.read_text() == "from the launcher\nfrom a worker"


@pytest.mark.processes
def test_no_view_is_in_the_help() -> None:
    result = subprocess.run([sys.executable, "-m", "elastictrain.cli", "run", "--help"],
                            capture_output=True, text=True, check=False,
                            env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0 and "--no-view" in result.stdout


