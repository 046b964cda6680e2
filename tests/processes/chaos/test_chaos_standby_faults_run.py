"""The chaos faults of the standby on real processes: a real standby stopped or killed with
a real worker leaves the restart's spawn to ``Popen`` and no worker behind; a PID
namespace of the test's own is recognised with its own /proc."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastictrain.chaos.runner import (
    in_child_pid_namespace,
    inject_standby_fault,
    standby_pid,
)
from elastictrain.launcher.standby.client import Standby, StandbyUnavailable
from tests.helpers import pid_alive, wait_for


@pytest.mark.processes
@pytest.mark.parametrize("kind", ["standby_stop", "standby_kill"])
def test_the_fault_leaves_the_next_spawn_to_popen_and_no_worker_behind(
        tmp_path: Path, kind: str) -> None:
    server = Standby(("json",), ready_timeout_s=60)
    server.start()
    assert server.ready() and server.pid is not None
    ready = tmp_path / "ready"
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(f"""
        import time
        open({str(ready)!r}, "w").close()
        time.sleep(600)
    """))
    worker = server.spawn(["-u", str(job)], dict(os.environ), None, None)
    try:
        wait_for(ready.exists, 60, "the worker to start")
        assert standby_pid(os.getpid()) == server.pid
        note = inject_standby_fault(kind, os.getpid(), 0, worker.pid)
        assert note is not None and str(server.pid) in note
        assert worker.wait(timeout=60) == -signal.SIGKILL
        server.spawn_timeout_s = 2.0  # a stopped standby never answers
        with pytest.raises(StandbyUnavailable):
            server.spawn(["-u", str(job)], dict(os.environ), None, None)
        assert not pid_alive(server.pid)
    finally:
        if pid_alive(worker.pid):
            os.kill(worker.pid, signal.SIGKILL)
        server.close()


@pytest.mark.processes
def test_a_pid_namespace_of_our_own_is_recognised_with_its_own_proc(tmp_path: Path) -> None:
    if in_child_pid_namespace():
        pytest.skip("already in a PID namespace")
    probe = ("from elastictrain.chaos.runner import in_child_pid_namespace as f; "
             "print(f())")
    unshare = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", probe]
    done = subprocess.run(unshare, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0 and "Operation not permitted" in done.stderr:
        pytest.skip(f"unshare refused here: {done.stderr.strip()}")
    assert done.stdout.strip() == "True", done.stderr


