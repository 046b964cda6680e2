"""The agent's handle on its standby process (:mod:`elastictrain.launcher.standby.server`).

:class:`Standby` starts the standby, waits for its imports, and asks it for workers;
each worker is a :class:`StandbyProcess`, which answers ``pid``, ``poll()`` and
``wait()`` as a ``subprocess.Popen`` would, so torchrun's bookkeeping is unchanged.

The agent knows every worker's true exit code however the standby fares: it makes
itself a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``) before starting the
standby, so when the standby dies its workers re-parent to the agent, which then waits
for them itself. Exits are matched by request number and process start time, never by
pid alone (a pid is reused once its process is reaped). A spawn the standby does not
answer in time ends the standby (SIGKILL, stopped or not) and every process it forked
that nobody holds, before the caller starts the group with ``Popen``: no second worker
for the same rank can start later.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from elastictrain.core.errors import ElasticTrainError
from elastictrain.core.proc import start_ticks, stat_fields

EXIT_UNKNOWN = 255  # the standby reaped a worker, then died before reporting its code
SPAWN_TIMEOUT_S = 30.0
# A worker that ended stays a zombie until its parent reaps it; the standby reaps at
# once, so one left this long means a stopped or stuck standby: it is ended, and the
# worker, adopted here, is waited for here.
UNREAPED_GRACE_S = 5.0
_PR_SET_CHILD_SUBREAPER = 36

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
from elastictrain.launcher.standby.server import run
run(sys.argv[1:])
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
        self._proc: subprocess.Popen[bytes] | ForkedProcess | None = None
        self._pending = b""
        self._exits: dict[int, int] = {}  # request number -> exit code
        self._replies: dict[int, dict[str, Any]] = {}
        self._titles: set[str] = set()  # the commands of requested workers (their titles)
        self._handed: set[int] = set()  # pids of workers handed out (their holders stop them)
        self.spawn_timeout_s = SPAWN_TIMEOUT_S
        self.unreaped_grace_s = UNREAPED_GRACE_S
        self._unreaped: dict[int, float] = {}  # request number -> when first seen a zombie
        self.subreaper = False
        self._next = 0
        self._lost = False
        self._ready: bool | None = None
        self.started_at = 0.0
        self._lock = threading.RLock()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Take the standby forked from the launcher (:func:`fork_from_launcher`), or
        start a new one; its imports run while the agent goes on."""
        global _forked
        forked, _forked = _forked, None
        if forked is not None and forked.modules == tuple(self.modules):
            self._proc, self._sock = forked.proc, forked.sock
            self.subreaper, self.started_at = forked.subreaper, forked.started_at
            self.info["from_launcher"] = True
            return
        if forked is not None:  # other modules: closing its socket ends it
            forked.sock.close()
        self.info["from_launcher"] = False
        # Before the standby exists: its forks must re-parent to us if it dies.
        self.subreaper = become_subreaper()
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
            number = self._next
            request = {"spawn": number, "argv": list(argv), "env": env,
                       "cwd": os.getcwd(), "stdout": stdout, "stderr": stderr}
            self._titles.add(" ".join([sys.executable, *argv]))
            try:
                self._sock.sendall(json.dumps(request).encode() + b"\n")
            except OSError as exc:
                raise self._abandon(f"standby gone: {exc}") from exc
            deadline = time.monotonic() + self.spawn_timeout_s
            try:
                while number not in self._replies:
                    if not self._read(deadline - time.monotonic()):
                        raise self._abandon(
                            "the standby ended before answering a spawn request" if self._lost
                            else f"spawn failed after {self.spawn_timeout_s:.1f}s (no answer)")
            except StandbyUnavailable:
                raise
            except BaseException:
                # A notice (torchrun's handler raises SignalException) while the standby
                # forked this worker: nobody will hold it to stop it, so it is stopped here.
                self._stop_unanswered(number)
                raise
            pid = int(self._replies.pop(number)["pid"])
            self._handed.add(pid)
            return StandbyProcess(self, number, pid, start_ticks(pid))

    def exit_code(self, worker: StandbyProcess, timeout_s: float = 0.0) -> int | None:
        """``worker``'s exit code once known (None while it runs): reported by the
        standby, or, once the standby is gone, from waiting for it here."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if worker.spawn in self._exits:
                    return self._exits[worker.spawn]
                if self._lost:
                    return self._wait_adopted(worker)
                if not self._read(max(0.0, deadline - time.monotonic())) and (
                        time.monotonic() >= deadline):
                    if self._left_unreaped(worker):
                        self._abandon("the standby left a worker unreaped for "
                                      f"{self.unreaped_grace_s:g}s (stopped or stuck)")
                        return self._wait_adopted(worker)
                    return None

    def _left_unreaped(self, worker: StandbyProcess) -> bool:
        """Whether ``worker`` ended and the standby has not reaped it for the grace."""
        try:
            fields = stat_fields(worker.pid)
            zombie = fields[0] == "Z" and int(fields[19]) == worker.started
        except (OSError, IndexError, ValueError):
            zombie = False
        if not zombie:
            self._unreaped.pop(worker.spawn, None)
            return False
        since = self._unreaped.setdefault(worker.spawn, time.monotonic())
        return time.monotonic() - since >= self.unreaped_grace_s

    def _wait_adopted(self, worker: StandbyProcess) -> int | None:
        """With the standby gone its workers are this process's children (subreaper):
        wait for ``worker`` here. A pid whose process started at another time is no
        longer the worker (the standby reaped it, then died before reporting)."""
        started = start_ticks(worker.pid)
        if started is None or started != worker.started:
            code = EXIT_UNKNOWN
        else:
            try:
                done, status = os.waitpid(worker.pid, os.WNOHANG)
            except ChildProcessError:  # not (yet) ours: still being re-parented, or no
                return self._not_adopted(worker.pid)  # subreaper here
            if done == 0:
                return None
            code = os.waitstatus_to_exitcode(status)
        self._exits[worker.spawn] = code
        return code

    def _not_adopted(self, pid: int) -> int | None:
        """A worker that is not this process's child: running (None), or, a zombie
        another process adopted (no subreaper), reaped by someone else: unknown."""
        try:
            fields = stat_fields(pid)
        except (OSError, IndexError):
            return EXIT_UNKNOWN
        being_adopted = self.subreaper and fields[1] != str(os.getpid())
        return None if fields[0] not in ("Z", "X") or being_adopted else EXIT_UNKNOWN

    def _stop_unanswered(self, number: int) -> None:
        """SIGKILL the worker of spawn request ``number``, which the agent stopped waiting
        for, once the standby names it (within ``spawn_timeout_s``, as any answer)."""
        deadline = time.monotonic() + self.spawn_timeout_s
        while number not in self._replies and not self._lost:
            if not self._read(deadline - time.monotonic()):
                return
        reply = self._replies.pop(number, None)
        if reply is None:
            return
        signal_worker(int(reply["pid"]), signal.SIGKILL)

    def _abandon(self, reason: str) -> StandbyUnavailable:
        """Stop using the standby for good: SIGKILL it (a stopped one too) so it forks
        nothing more, then every process it forked that no holder stops (a request it
        answered late, or forked before dying). Returns the error to raise."""
        self._lost = True
        self.info.setdefault("reason", reason)
        killed: list[int] = []
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()  # once reaped, its children are ours (subreaper)
            killed = [pid for pid in _children(os.getpid())
                      if pid not in self._handed and self._forked_by_standby(pid)]
            for pid in killed:
                _kill_and_reap(pid)
        self.info["orphans_killed"] = killed
        return StandbyUnavailable(f"{reason}; standby ended, its unanswered workers "
                                  f"killed: {killed or 'none'}")

    def _forked_by_standby(self, pid: int) -> bool:
        """Whether child ``pid`` is a fork of the standby: still titled as the standby
        (it had not become the worker yet) or titled as a requested worker."""
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            return False
        return title.startswith(f"elastictrain standby (agent {os.getpid()})") or (
            title in self._titles)

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
            if message.get("spawn") is not None:
                self._exits[int(message["spawn"])] = int(message["code"])
            self._handed.discard(int(message["exited"]))
        elif "spawned" in message:
            self._replies[int(message["spawned"])] = message
        elif "ready" in message:
            self._ready = bool(message["ready"])
            self.info.update(message)
            # preload_s misses the imports BOOT's `import elastictrain` already did.
            self.info["ready_after_s"] = round(time.monotonic() - self.started_at, 3)


def become_subreaper() -> bool:
    """Make this process adopt its descendants' orphans (Linux); False elsewhere or
    when refused (then a worker whose standby died is known only as running or not)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0


def _children(parent: int) -> list[int]:
    """The pids whose parent is ``parent``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(stat_fields(entry)[1]) == parent:
                    found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue  # ended during the walk
    return found


def signal_worker(pid: int, sig: signal.Signals) -> None:
    """Signal a forked worker's process group (it calls setsid(), as torchrun's Popen
    workers start sessions of their own), or the worker alone while it is not a group
    leader yet (just forked). A worker that already ended is left alone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _kill_and_reap(pid: int) -> None:
    """SIGKILL our child ``pid`` and its process group if it leads one (a worker
    calls setsid), then reap it."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass  # already gone (and reaped)


class StandbyProcess:
    """A worker forked by the standby, with the part of ``Popen``'s API torchrun uses.

    ``spawn`` (the request's number) and ``started`` (its start time) name this
    process for good; ``pid`` alone would not once it is reaped."""

    def __init__(self, standby: Standby, spawn: int, pid: int, started: int | None) -> None:
        self._standby = standby
        self.spawn = spawn
        self.pid = pid
        self.started = started
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._standby.exit_code(self)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        code = self.poll()
        while code is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"standby worker {self.pid}", timeout or 0)
            code = self.returncode = self._standby.exit_code(self, min(left, 1.0))
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


# -- a standby forked from the launcher -----------------------------------------------------
class ForkedProcess:
    """A child this process forked, with the part of ``Popen``'s API the standby's
    handle uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"standby {self.pid}", timeout or 0)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]  # set by poll()

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)


@dataclass
class _Forked:
    proc: ForkedProcess
    sock: socket.socket
    modules: tuple[str, ...]
    started_at: float
    subreaper: bool


_forked: _Forked | None = None  # forked by fork_from_launcher, until Standby.start() takes it


def fork_from_launcher(modules: Sequence[str], worker_title: str,
                       environ: dict[str, str]) -> str | None:
    """Fork this launcher into the standby that :meth:`Standby.start` then takes, so the
    torch the launcher imported is not imported again by a new process (figures:
    docs/recovery.md). None when forked, else why not (then ``start`` starts a new one).
    The standby imports ``modules`` under ``environ``, the environment the launcher
    goes on with (some of torch reads variables when imported).

    Called where the launcher holds nothing a worker must not inherit: no Python thread
    but this one, no logging set up, no ``with`` block open, and every frame above the
    caller lets ``SystemExit`` pass: a worker forked from the standby leaves through
    those frames, as it would from a new interpreter's top level. And before this
    process sets any environment variable (``_why_not_fork``).
    """
    global _forked
    why_not = _why_not_fork(worker_title)
    if why_not is not None:
        return why_not
    subreaper = become_subreaper()  # before the fork: the standby's orphans come here
    ours, theirs = socket.socketpair()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # or the child would write the launcher's buffered output again
    gc.freeze()  # the imports' objects stay shared with the standby, not copied on a GC
    pid = os.fork()
    if pid == 0:
        ours.close()
        _become_standby(theirs, modules, environ)
    theirs.close()
    _forked = _Forked(ForkedProcess(pid), ours, tuple(modules), time.monotonic(), subreaper)
    return None


def _why_not_fork(worker_title: str) -> str | None:
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if threading.active_count() > 1:
        return "the launcher runs other threads"
    try:  # /proc/<pid>/stat: where the command line's and the environment's strings are
        arg_start, arg_end, env_start, env_end = (int(f) for f in stat_fields("self")[45:49])
    except (OSError, IndexError, ValueError):
        return "no /proc/self/stat"
    # A worker's title takes the room of the launcher's command line (server._child).
    if len(worker_title) >= arg_end - arg_start:
        return "a worker's command line is longer than the launcher's"
    # setproctitle finds the command line's memory from the first environment string;
    # once this process has set a variable, that string may be a copy elsewhere, and
    # no title could be set.
    environ = ctypes.POINTER(ctypes.c_void_p).in_dll(ctypes.CDLL(None), "environ")
    if not environ or not env_start <= (environ[0] or 0) < env_end:
        return "the launcher changed its environment before the fork"
    return None


def _become_standby(sock: socket.socket, modules: Sequence[str],
                    environ: dict[str, str]) -> NoReturn:
    """The forked child: made what a new standby process (``BOOT``) is, then its loop."""
    os.environ["SPT_NOENV"] = "1"  # as BOOT sets it, before setproctitle is imported
    from elastictrain.launcher.standby import server

    server.take_title()  # setproctitle finds the command line's memory on its first call
    os.environ.clear()  # then the launcher's environment, under which a new standby
    os.environ.update(environ)  # would import

    try:
        for notice in server.NOTICES:  # a scheduler's notice is for the agent
            signal.signal(notice, signal.SIG_IGN)
        os.setsid()  # a Ctrl-C on the terminal is for the agent alone
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        # The standby's socket object (server.main) becomes the descriptor's only owner:
        # a second one here would close the same number again when a worker's frames
        # are freed at its exit, by then another file's (torch's store loop then spun).
        agent_fd = sock.detach()
        # What a new standby would not have: descriptors the launcher inherited (no
        # Python object owns them at this point).
        os.closerange(3, agent_fd)
        os.closerange(agent_fd + 1, os.sysconf("SC_OPEN_MAX"))
        for fd, name in ((1, "stdout"), (2, "stderr")):  # as ``python -u`` has them
            stream = getattr(sys, name)
            unbuffered = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False),
                                          encoding=stream.encoding, errors=stream.errors,
                                          write_through=True)
            setattr(sys, name, unbuffered)
            setattr(sys, f"__{name}__", unbuffered)
        server.run([f"--fd={agent_fd}", *modules])
    except BaseException:
        if server.in_worker():
            raise  # a worker's SystemExit (or KeyboardInterrupt) ends it as at top level
        traceback.print_exc()
        os._exit(1)
