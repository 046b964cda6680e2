"""The argv torchrun gives a worker's ``python`` is the one the standby runs (the standby
process itself: tests/processes/launcher/test_standby_server_run.py)."""
from __future__ import annotations

import sys

from elastictrain.launcher.standby.context import python_argv


def test_argv_torchrun_gives_python_is_what_the_standby_runs() -> None:
    py = sys.executable
    assert python_argv(py, ("-u", "train.py", "--lr", "1")) == ["-u", "train.py", "--lr", "1"]
    assert python_argv(py, ("-u", "-m", "pkg.train")) == ["-u", "-m", "pkg.train"]
    assert python_argv(py, ("-u", "-m")) is None  # nothing to run
    assert python_argv("/usr/bin/env", ("-u", "train.py")) is None  # --no-python
    assert python_argv(py, ("train.py",)) is None  # not torchrun's form
    assert python_argv(py, ("-u", "-c", "print(1)")) is None


