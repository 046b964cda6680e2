"""Shared helpers for tests that start real processes.

Every process a test starts is stopped by PID (its whole session), every port
is picked free, and every torchrun writes its scratch into the test's tmp dir.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# The training job of the end-to-end tests (one loop, options per test).
TRAIN_JOB = REPO / "tests" / "train_job.py"
# It as docs/faults.md runs it: a 1024-wide layer, storage faults switched by environment
# (FAULTS_JOB_*), a final snapshot; the snapshot policy from ELASTICTRAIN_*.
FAULTS_JOB_OPTIONS = ("--width=1024", "--store=faults", "--final-save")


def free_port() -> int:
    """A TCP port nobody listens on right now (bind to 0, read, release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Environment for a child: temp files in the test dir, unbuffered output."""
    env = dict(os.environ)
    env.update({"TMPDIR": str(tmp_path), "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1"})
    env.update(extra)
    return env


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun's workers run in sessions of their
    own, so a session's kill misses them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def kill_tree(pid: int) -> None:
    """SIGSTOP then SIGKILL ``pid``'s whole tree: stopped first, so that no member
    forks or is reparented out of the tree while it is killed."""
    tree = descendants(pid)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for member in tree:
            with suppress(ProcessLookupError):
                os.kill(member, sig)


def kill_session(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL a process started with start_new_session=True, its session and every
    process below it (workers in sessions of their own included)."""
    if proc.poll() is None:
        kill_tree(proc.pid)
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@contextmanager
def started(cmd: Sequence[str], tmp_path: Path, log_name: str = "proc.log",
            **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``cmd`` in its own session with output to ``tmp_path/log_name``;
    on exit from the block kill whatever is left of it."""
    log = open(tmp_path / log_name, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT,
                            env=child_env(tmp_path, **env), cwd=tmp_path,
                            start_new_session=True)
    try:
        yield proc
    finally:
        kill_session(proc)
        log.close()


def run_cli(args: Sequence[str], tmp_path: Path, timeout: float = 240,
            **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``elastictrain ARGS`` to completion (killed by PID group on timeout)."""
    proc = subprocess.Popen([sys.executable, "-m", "elastictrain.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(tmp_path, **env), cwd=tmp_path,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        out, err = proc.communicate()
        raise AssertionError(f"elastictrain {' '.join(args)} timed out\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_demo_json(tmp_path: Path, *args: str, timeout: float = 240) -> dict[str, Any]:
    """``elastictrain demo --json ARGS``; asserts success and returns the JSON."""
    result = run_cli(["demo", "--json", *args], tmp_path, timeout=timeout)
    assert result.returncode == 0, f"demo failed ({result.returncode}):\n{result.stderr[-4000:]}"
    return dict(json.loads(result.stdout))


def events(path: Path, name: str | None = None) -> list[dict[str, Any]]:
    """Events from every JSON-lines file under ``path`` (optionally one event name)."""
    found: list[dict[str, Any]] = []
    for file in sorted(path.rglob("*.jsonl")):
        for line in file.read_text().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if name is None or event.get("event") == name:
                found.append(event)
    return found


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll ``predicate`` until true (a condition, not a sleep: fails after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie or a reaped process does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
