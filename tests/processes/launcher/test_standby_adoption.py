"""The agent knows every standby worker it started, and only those (issue 24, cases 10
and 11), with a real standby and real workers:

* the standby stopped or killed right after a fork, before its answer (a fork hook it
  preloads does it to itself, every time): the spawn fails, the standby ends, and the
  worker it forked is killed and reaped; none starts later;
* the standby killed under running workers: a worker's 75 or 0 is still its code;
* a pid recycled onto a new worker (a PID namespace whose next pid is set): the new
  worker runs, whatever the old one's code was.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastictrain.launcher.standby.client import Standby, StandbyUnavailable
from tests.helpers import REPO, pid_alive, wait_for

pytestmark = pytest.mark.processes

PRELOAD = ("json",)
ROOT = REPO


def _script(tmp_path: Path, body: str, name: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


@pytest.fixture
def standbys() -> Iterator[list[Standby]]:
    """Standbys a test starts, closed (and their pids checked) at its end."""
    started: list[Standby] = []
    yield started
    for server in started:
        server.close()
        assert server.pid is not None and not pid_alive(server.pid)


def _start(standbys: list[Standby], modules: tuple[str, ...] = PRELOAD) -> Standby:
    server = Standby(modules, ready_timeout_s=60)
    server.start()
    standbys.append(server)
    assert server.ready()
    return server


@pytest.mark.parametrize("fault", ["stop", "kill"])
def test_a_standby_stopped_or_killed_between_fork_and_answer_leaves_no_worker(
        standbys: list[Standby], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        fault: str) -> None:
    monkeypatch.setenv("ET_TEST_STANDBY_AFTER_FORK", fault)
    server = _start(standbys, (*PRELOAD, "tests.standby_fork_hook"))
    server.spawn_timeout_s = 3.0  # the answer that never comes: the agent gives up
    standby_pid = server.pid
    assert standby_pid is not None
    pids = tmp_path / "pids"
    job = _script(tmp_path, f"""
        import os, time
        with open({str(pids)!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        time.sleep(600)
    """, "rank0.py")
    env = {**os.environ, "RANK": "0"}
    try:
        with pytest.raises(StandbyUnavailable, match=r"killed: \[\d+\]"):
            server.spawn(["-u", str(job)], env, None, None)
        (orphan,) = server.info["orphans_killed"]
        assert not pid_alive(standby_pid)
        assert not Path(f"/proc/{orphan}").exists()  # killed and reaped: nobody's zombie
        assert not server.ready()
    finally:  # a worker the fix failed to end would outlive the test: end it by pid
        for line in (pids.read_text().split() if pids.exists() else []):
            if pid_alive(int(line)):
                os.kill(int(line), signal.SIGKILL)
        if pid_alive(standby_pid):
            os.kill(standby_pid, signal.SIGKILL)


@pytest.mark.parametrize("code", [75, 0, 3])
def test_a_workers_code_after_its_standby_died_is_its_own(
        standbys: list[Standby], tmp_path: Path, code: int) -> None:
    server = _start(standbys)
    go, ready = tmp_path / "go", tmp_path / "ready"
    job = _script(tmp_path, f"""
        import os, sys, time
        open({str(ready)!r}, "w").close()
        while not os.path.exists({str(go)!r}):  # the test's go-ahead, a file
            time.sleep(0.01)
        sys.exit({code})
    """, "worker.py")
    proc = server.spawn(["-u", str(job)], dict(os.environ), None, None)
    try:
        wait_for(ready.exists, 60, "the worker to start")
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)
        assert proc.poll() is None  # still running: the standby's end is not its end
        go.touch()
        assert proc.wait(timeout=60) == code  # read 255 before
    finally:
        if pid_alive(proc.pid):
            os.kill(proc.pid, signal.SIGKILL)


_RECYCLE = """
import json, os, signal, sys, time
sys.path.insert(0, {root!r})
from elastictrain.launcher.standby.client import Standby

server = Standby(("json",), ready_timeout_s=60)
server.start()
assert server.ready()
env = dict(os.environ)
old = server.spawn(["-u", {sleeper!r}], env, None, None)
os.kill(old.pid, signal.SIGKILL)
old_code = old.wait(timeout=60)
# The next pid this namespace hands out is the old worker's: the standby's fork.
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(old.pid - 1))
new = server.spawn(["-u", {sleeper!r}], env, None, None)
result = {{"old_pid": old.pid, "old_code": old_code, "new_pid": new.pid,
          "new_poll": new.poll()}}
os.kill(new.pid, signal.SIGKILL)
result["new_code"] = new.wait(timeout=60)
server.close()
print(json.dumps(result))
"""


def test_a_recycled_pid_is_a_new_worker_not_the_old_ones_exit(tmp_path: Path) -> None:
    sleeper = _script(tmp_path, "import time\ntime.sleep(600)\n", "sleeper.py")
    agent = _script(tmp_path, _RECYCLE.format(root=str(ROOT), sleeper=str(sleeper)),
                    "agent.py")
    unshare = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc",
                                sys.executable, str(agent)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = unshare.communicate(timeout=120)
    finally:
        if unshare.poll() is None:  # its namespace's processes die with its init
            os.killpg(unshare.pid, signal.SIGKILL)
            unshare.wait()
    if unshare.returncode != 0 and ("Operation not permitted" in err
                                    or "unshare failed" in err):
        pytest.skip(f"no PID namespace here: {err.strip()[:200]}")
    assert unshare.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    if result["new_pid"] != result["old_pid"]:
        pytest.skip(f"the pid was not recycled here: {result}")
    assert result["old_code"] == -signal.SIGKILL
    assert result["new_poll"] is None  # -9 before: the old worker's code, by pid
    assert result["new_code"] == -signal.SIGKILL


def test_a_stopped_standby_does_not_hide_a_workers_end(
        standbys: list[Standby], tmp_path: Path) -> None:
    """SIGSTOPped, the standby reaps and reports nothing: the worker's zombie, left
    unreaped past the grace, ends the standby and its code (75) is read here."""
    server = _start(standbys)
    server.unreaped_grace_s = 1.0
    go, ready = tmp_path / "go", tmp_path / "ready"
    job = _script(tmp_path, f"""
        import os, sys, time
        open({str(ready)!r}, "w").close()
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        sys.exit(75)
    """, "worker.py")
    proc = server.spawn(["-u", str(job)], dict(os.environ), None, None)
    try:
        wait_for(ready.exists, 60, "the worker to start")
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)
        go.touch()
        assert proc.wait(timeout=60) == 75  # never answered before: the wait timed out
        assert not pid_alive(server.pid) and not server.ready()
    finally:
        if pid_alive(proc.pid):
            os.kill(proc.pid, signal.SIGKILL)
