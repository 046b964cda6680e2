"""The CLI module imports without torch, checked in a fresh interpreter."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.processes
def test_the_cli_module_imports_without_torch() -> None:
    probe = "import sys, elastictrain.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"


