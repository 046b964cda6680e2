"""The operator's commands that only read (``status``, ``goodput``, ``snapshots``) load
without torch: importing it takes seconds, and a look at a run should not. Nor does the
demo's own process, which checks the storage before it starts the job's processes (each
of which imports torch anyway)."""

from __future__ import annotations

import subprocess
import sys

import pytest

READ_ONLY = ("elastictrain.cli", "elastictrain.view.ops", "elastictrain.view.status",
             "elastictrain.runlog.goodput", "elastictrain.runlog.accounting.split",
             "elastictrain.demo.runner")


@pytest.mark.processes
def test_the_read_only_commands_import_no_torch() -> None:
    code = (f"import sys\nfor name in {READ_ONLY!r}:\n    __import__(name)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout[:2000]
