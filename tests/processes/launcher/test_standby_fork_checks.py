"""When the launcher may fork its standby (``standby.client._why_not_fork``): each
case in a new interpreter, where this process's own threads and environment cannot
interfere (pytest-xdist runs threads of its own)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes

CHECK = """\
import os, sys, threading
from elastictrain.launcher.standby.client import _why_not_fork
case = sys.argv[1]
if case == "fits":
    print(_why_not_fork("x" * 10))
elif case == "longer than the command line":
    print(_why_not_fork("x" * 100_000))
elif case == "a new variable":
    os.environ["ET_TEST_NEW_VARIABLE"] = "1"  # appended: the first string stays put
    print(_why_not_fork("x" * 10))
elif case == "every variable set again":
    os.environ.update(dict(os.environ))  # copies: setproctitle would find no command line
    print(_why_not_fork("x" * 10))
elif case == "a thread":
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    print(_why_not_fork("x" * 10))
    stop.set()
    thread.join()
"""


@pytest.mark.parametrize(("case", "why_not"), [
    ("fits", "None"),
    ("longer than the command line", "a worker's command line is longer than the launcher's"),
    ("a new variable", "None"),
    ("every variable set again", "the launcher changed its environment before the fork"),
    ("a thread", "the launcher runs other threads"),
])
def test_the_launcher_forks_its_standby_only_where_a_worker_keeps_its_title(
        case: str, why_not: str) -> None:
    result = subprocess.run([sys.executable, "-c", CHECK, case, "padding " * 4],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == why_not
