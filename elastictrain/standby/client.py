"""The agent's handle on its standby process (:mod:`elastictrain.standby.server`).

:class:`Standby` starts the standby, waits for its imports, and asks it for workers;
each worker is a :class:`StandbyProcess`, which answers ``pid``, ``poll()`` and
``wait()`` as a ``subprocess.Popen`` would, so torchrun's bookkeeping is unchanged.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from elastictrain.errors import ElasticTrainError
from elastictrain.proctree import is_running

EXIT_UNKNOWN = 255  # the standby died before reporting a worker's end

# Notices are ignored before anything is imported (importing elastictrain imports torch,
# a second and more during which a scheduler's signal to the whole job would kill it).
# SPT_NOENV: setproctitle must not reuse the environment's memory for titles, or
# /proc/<pid>/environ of the standby and its workers would show a title (tools find a
# job's processes there: elastictrain chaos does); the trailing comment is the room
# the titles get instead (the command line's own memory).
BOOT = """\
import os, signal, sys
for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
    signal.signal(getattr(signal, name), signal.SIG_IGN)
os.environ["SPT_NOENV"] = "1"
from elastictrain.standby.server import main
sys.exit(main(sys.argv[1:]))
#""" + " " * 4096


class StandbyUnavailable(ElasticTrainError):
    """The standby could not start or stopped answering: start workers the usual way."""


class Standby:
    """One standby process per agent; its forks become the agent's workers."""

    def __init__(self, modules: Sequence[str], ready_timeout_s: float = 300.0) -> None:
        self.modules = list(modules)
        self.ready_timeout_s = ready_timeout_s
        self.info: dict[str, Any] = {}
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._pending = b""
        self._exits: dict[int, int] = {}
        self._replies: dict[int, dict[str, Any]] = {}
        self._next = 0
        self._lost = False
        self._ready: bool | None = None
        self.started_at = 0.0
        self._lock = threading.RLock()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Start the standby process; its imports run while the agent goes on."""
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-u", "-c", BOOT, f"--fd={theirs.fileno()}", *self.modules],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
            start_new_session=True)  # a Ctrl-C on the terminal is for the agent alone
        theirs.close()
        self._sock = ours
        self.started_at = time.monotonic()

    def ready(self) -> bool:
        """Wait for the standby's imports; False (and the reason in ``info``) when it
        cannot serve, so the caller starts workers with ``Popen`` instead."""
        with self._lock:
            if self._ready is None:
                deadline = time.monotonic() + self.ready_timeout_s
                while self._ready is None and not self._lost:
                    if not self._read(deadline - time.monotonic()):
                        self.info.setdefault("reason", "no answer within "
                                             f"{self.ready_timeout_s:.0f} s")
                        self._lost = True
                if self._ready is None:
                    self._ready = False
            return bool(self._ready) and not self._lost

    def spawn(self, argv: Sequence[str], env: dict[str, str], stdout: str | None,
              stderr: str | None) -> StandbyProcess:
        """A new worker running ``python argv`` with exactly ``env``.

        Raises:
            StandbyUnavailable: the standby is not serving.
        """
        with self._lock:
            if not self.ready() or self._sock is None:
                raise StandbyUnavailable(f"standby not available: {self.info.get('reason')}")
            self._next += 1
            request = {"spawn": self._next, "argv": list(argv), "env": env,
                       "cwd": os.getcwd(), "stdout": stdout, "stderr": stderr}
            try:
                self._sock.sendall(json.dumps(request).encode() + b"\n")
            except OSError as exc:
                self._lost = True
                raise StandbyUnavailable(f"standby gone: {exc}") from exc
            deadline = time.monotonic() + 30.0
            while self._next not in self._replies:
                if not self._read(deadline - time.monotonic()):
                    self._lost = True
                    raise StandbyUnavailable("standby did not answer a spawn request")
            return StandbyProcess(self, int(self._replies.pop(self._next)["pid"]))

    def exit_code(self, pid: int, timeout_s: float = 0.0) -> int | None:
        """``pid``'s exit code once the standby reported it (None while it runs)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if pid in self._exits:
                    return self._exits[pid]
                if self._lost:
                    return _code_without_report(pid)
                if not self._read(max(0.0, deadline - time.monotonic())) and (
                        time.monotonic() >= deadline):
                    return None

    def close(self) -> None:
        """End the standby (its workers are not touched)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._lost = True

    def _read(self, timeout_s: float) -> bool:
        """Take in what the standby sent within ``timeout_s``; False when nothing came
        (or it is gone, which sets ``_lost``)."""
        if self._sock is None:
            self._lost = True
            return False
        readable, _, _ = select.select([self._sock], [], [], max(0.0, timeout_s))
        if not readable:
            return False
        try:
            chunk = self._sock.recv(65536)
        except OSError:  # reset: it died with our request unread
            chunk = b""
        if not chunk:
            self._lost = True
            self.info.setdefault("reason", "the standby process ended")
            return False
        self._pending += chunk
        while b"\n" in self._pending:
            line, self._pending = self._pending.split(b"\n", 1)
            self._take(json.loads(line))
        return True

    def _take(self, message: dict[str, Any]) -> None:
        if "exited" in message:
            self._exits[int(message["exited"])] = int(message["code"])
        elif "spawned" in message:
            self._replies[int(message["spawned"])] = message
        elif "ready" in message:
            self._ready = bool(message["ready"])
            self.info.update(message)
            # preload_s misses the imports BOOT's `import elastictrain` already did.
            self.info["ready_after_s"] = round(time.monotonic() - self.started_at, 3)


def _code_without_report(pid: int) -> int | None:
    """With the standby gone, its orphaned children are reaped by someone else: all we
    can tell is whether ``pid`` still runs (a zombie does not: whoever adopted it may
    never reap it, a container's PID 1 among them)."""
    return None if is_running(pid) else EXIT_UNKNOWN


class StandbyProcess:
    """A worker forked by the standby, with the part of ``Popen``'s API torchrun uses."""

    def __init__(self, standby: Standby, pid: int) -> None:
        self._standby = standby
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._standby.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        code = self.poll()
        while code is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"standby worker {self.pid}", timeout or 0)
            code = self.returncode = self._standby.exit_code(self.pid, min(left, 1.0))
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)
