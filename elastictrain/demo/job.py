"""A launched demo job, and what Ctrl-C or SIGTERM to the demo does to it.

Each launcher (one, or one per node with ``--nnodes``) runs in its own session
(so it can be stopped as a unit), so a terminal's Ctrl-C reaches only the demo
process. While the demo waits, the first SIGINT or SIGTERM is passed on to every
launcher as SIGTERM, the notice path: every worker takes a final snapshot and
the launchers exit 75. A second signal forces: SIGKILL to each launcher's session
and to each worker by PID (workers run in sessions of their own).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from elastictrain.runlog.events_read import read_events


@dataclass
class RunningJob:
    """The demo's job while it runs: its event log and its launcher processes (a node
    started later is appended to ``launchers``).

    ``interrupted`` is the name of the first signal the demo received (None while
    nobody asked it to stop); ``forced`` is True once a second one killed the job.
    """

    events_dir: str
    launchers: list[subprocess.Popen[bytes]]
    interrupted: str | None = None
    forced: bool = False
    # Where the demo says what a signal does (the live view's lines while it draws).
    announce: Callable[[str], None] | None = None

    def worker_pids(self) -> list[int]:
        """Every worker this job started so far (``worker.start`` events carry the pid)."""
        pids = []
        for path in sorted(Path(self.events_dir).rglob("attempt*-rank*.jsonl")):
            pids += [int(e["pid"]) for e in read_events(path) if e.get("event") == "worker.start"]
        return pids

    def interrupt(self, signum: int) -> None:
        """First signal: ask the job for a final snapshot; second: kill it."""
        name = signal.Signals(signum).name
        pids = [p.pid for p in self.launchers if p.poll() is None]
        if self.interrupted is None:
            self.interrupted = name
            self._say(f"{name}: asking the job for a final snapshot (launcher pid "
                      f"{_pids(pids)}); Ctrl-C again to force")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            return
        self.forced = True
        self._say(f"{name} again: killing the launcher (pid {_pids(pids)}) and workers "
                  f"{self.worker_pids()} with SIGKILL; no final snapshot")
        self.kill()

    def _say(self, message: str) -> None:
        (self.announce or _say)(message)

    def kill(self) -> None:
        """SIGKILL each launcher's session and every worker of this job still running."""
        for launcher in self.launchers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)
        for pid in self.worker_pids():
            if self._is_ours(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def _is_ours(self, pid: int) -> bool:
        """A worker of this job (its arguments name this run's events dir), not a process
        that got a recycled pid."""
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False  # gone
        return f"--events-dir={self.events_dir}".encode() in cmdline

    def wait(self) -> int:
        """Wait for the launchers with SIGINT/SIGTERM routed to :meth:`interrupt`; then
        make sure no worker of the job is left. Returns the first non-zero exit code."""
        with self.signals_routed():
            codes = [launcher.wait() for launcher in self.launchers]
        self.reap()
        return next((c for c in codes if c != 0), 0)

    def signals_routed(self) -> contextlib.AbstractContextManager[None]:
        """While inside, SIGINT and SIGTERM to the demo go to :meth:`interrupt`."""
        return _handling(self.interrupt)

    def reap(self) -> None:
        """After an interrupt, once the launchers are gone: a worker they could not stop
        is not left behind."""
        if self.interrupted is not None:
            self.kill()


def _pids(pids: list[int]) -> str:
    return ", ".join(map(str, pids)) or "none running"


def _say(message: str) -> None:
    sys.stderr.write(f"elastictrain demo: {message}\n")
    sys.stderr.flush()


@contextlib.contextmanager
def _handling(handler: Callable[[int], None]) -> Iterator[None]:
    def on_signal(signum: int, frame: FrameType | None) -> None:
        handler(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
