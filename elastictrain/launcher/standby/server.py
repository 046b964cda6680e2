"""The standby process: imports the heavy modules once, then forks workers on request.

Started by the agent (``client.BOOT``: notices ignored, then :func:`main` with
``--fd N MODULE...``) before any worker, it imports the modules named on its command line and never
touches an accelerator, opens a process group or starts a thread of its own, so a
``fork`` of it is as clean as a new interpreter that has done those imports.

One Unix socket to the agent carries JSON lines:

* standby → agent, once: ``{"ready": true, "preload_s": S, "failed": {MODULE: ERROR},
  "absent": [MODULE...]}`` (absent: not installed),
  or ``{"ready": false, "reason": ...}`` when the preload initialised CUDA (a forked
  child could not use it);
* agent → standby: ``{"spawn": N, "argv": [...], "env": {...}, "cwd": DIR,
  "stdout": PATH|null, "stderr": PATH|null}``, answered by ``{"spawned": N, "pid": P}``;
* standby → agent, whenever a child ends: ``{"exited": P, "spawn": N, "code": C}`` with
  ``C`` as ``Popen.returncode`` gives it (``-N`` for signal ``N``); ``N`` names the
  request, so a later worker that gets the same pid is never taken for this one.

The agent closing its end ends the standby; workers already started keep running,
as workers started with ``Popen`` do when their launcher dies. Notice signals are
ignored here (a scheduler may signal every process of a job) and restored in workers.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import runpy
import selectors
import signal
import socket
import sys
import time
import traceback
from typing import Any, NoReturn

from setproctitle import setproctitle

from elastictrain.core.env import getenv
from elastictrain.runlog.failure import record_uncaught

# torchrun gives each worker this file; its agent reads it when the worker fails.
ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"

PYTHON_FLAGS = ("-u",)  # what torchrun puts before the script; the standby runs with -u


# Notices a scheduler may send to every process of the job (Slurm signals a whole step):
# they are for the agent and the workers; the standby ends when the agent does.
NOTICES = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
           signal.SIGUSR2)


def main(argv: list[str] | None = None) -> int:
    for notice in NOTICES:  # already, by client.BOOT; again for a direct call
        signal.signal(notice, signal.SIG_IGN)
    take_title()
    parser = argparse.ArgumentParser(prog="elastictrain standby")
    parser.add_argument("--fd", type=int, required=True, help="the agent's socket")
    parser.add_argument("modules", nargs="*", help="modules to import before any fork")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    started = time.monotonic()
    failed, absent = preload(args.modules)
    reason = _unforkable()
    if reason:
        _send(sock, {"ready": False, "reason": reason})
        return 1
    _send(sock, {"ready": True, "preload_s": round(time.monotonic() - started, 3),
                 "failed": failed, "absent": absent,
                 "threads": len(os.listdir("/proc/self/task"))})
    serve(sock)
    return 0


def take_title() -> None:
    """Show as the standby of the agent that started it (tools find it by this title)."""
    setproctitle(f"elastictrain standby (agent {os.getppid()})")


def preload(modules: list[str]) -> tuple[dict[str, str], list[str]]:
    """Import ``modules``; return those that failed with their error (they are simply
    imported again, by the worker that needs them) and those not installed at all."""
    failed, absent = {}, []
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name.split(".")[0]:
                absent.append(name)  # an optional library (s3fs) this machine lacks
            else:
                failed[name] = f"{type(exc).__name__}: {exc}"[:300]
        except Exception as exc:  # any import error: the worker will see it itself
            failed[name] = f"{type(exc).__name__}: {exc}"[:300]
    return failed, absent


def _unforkable() -> str | None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "a preloaded module initialised CUDA, which a forked worker cannot use"
    return None


def serve(sock: socket.socket) -> None:
    """Answer spawn requests and report exits until the agent closes the socket."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler, so the fd is written
    signal.set_wakeup_fd(wake_w)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    pending = b""
    spawns: dict[int, int] = {}  # pid -> request number, until reaped
    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_r:
                os.read(wake_r, 4096)
                _report_exits(sock, spawns)
                continue
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:  # the agent died (its node was lost): as closed
                return
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request, sock, selector, (wake_r, wake_w))
                spawns[pid] = int(request["spawn"])
                _send(sock, {"spawned": request["spawn"], "pid": pid})
        _report_exits(sock, spawns)  # a child may have ended before the handler was set


def _report_exits(sock: socket.socket, spawns: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "spawn": spawns.pop(pid, None),
                     "code": os.waitstatus_to_exitcode(status)})


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


# -- the forked worker ----------------------------------------------------------------------
def _child(request: dict[str, Any], sock: socket.socket, selector: selectors.BaseSelector,
           pipe: tuple[int, int]) -> NoReturn:
    """Become the worker ``request`` describes, run it, and leave the way a fresh
    interpreter does: ``SystemExit`` up to the top, then the interpreter's own
    finalization (threads joined, ``atexit``, objects torn down while finalizing: a
    process group's destructor then no longer waits on a thread that wants the GIL)."""
    global _in_worker
    _in_worker = True
    try:
        signal.set_wakeup_fd(-1)
        # The standby's descriptors are closed through the objects that own them. A bare
        # os.close(sock.fileno()) leaves the socket object to close the same number again
        # when it is finalized at exit, by then another file's: gloo's epoll descriptor,
        # whose loop thread then aborted the worker (SIGABRT) after a clean end.
        selector.close()
        sock.close()
        for fd in pipe:
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for notice in NOTICES:  # as a new interpreter has them
            signal.signal(notice, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # ps, pkill -f and /proc/<pid>/cmdline show the worker's command, as after Popen.
        setproctitle(" ".join([sys.executable, *request["argv"]]))
        os.setsid()  # as torchrun's Popen(start_new_session=True): signalled as a group
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            if path:
                target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(target, fd)
                os.close(target)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _reseed()
        _threads_from_environment()
    except BaseException:  # the worker's own setup failed: say why, like a crash
        traceback.print_exc()
        os._exit(1)
    raise SystemExit(run_python(request["argv"]))


def _reseed() -> None:
    """A fork shares its parent's random state; fresh interpreters each seed their own."""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _threads_from_environment() -> None:
    """torch sizes its thread pool from ``OMP_NUM_THREADS`` when imported, which the
    standby did under its own environment: apply the worker's value."""
    torch = sys.modules.get("torch")
    value = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and value.isdigit() and int(value) > 0:
        torch.set_num_threads(int(value))


_in_worker = False  # set in a forked worker, from the moment it stops being the standby


def in_worker() -> bool:
    """Whether this process is a worker forked by the standby (not the standby)."""
    return _in_worker


# What the script left behind, held until the interpreter finalizes: freed earlier,
# its objects would be torn down outside finalization, where a gloo process group's
# destructor can deadlock with its own threads (docs/recovery.md).
_LEFT_BEHIND: list[object] = []


def run_python(argv: list[str]) -> int:
    """Run ``[-u] SCRIPT ARGS`` or ``[-u] -m MODULE ARGS`` as ``python`` would, as
    ``__main__``, and return the exit code a fresh interpreter would exit with (an
    uncaught ``KeyboardInterrupt`` propagates: the interpreter then ends by SIGINT)."""
    args = [a for a in argv if a not in PYTHON_FLAGS]
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = os.getcwd()
            _LEFT_BEHIND.append(runpy.run_module(args[1], run_name="__main__",
                                                 alter_sys=True))
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            _LEFT_BEHIND.append(runpy.run_path(args[0], run_name="__main__"))
        return 0
    except SystemExit as exc:
        _LEFT_BEHIND.append(exc)  # its traceback holds the script's frames
        return _exit_code(exc.code)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        _LEFT_BEHIND.append(exc)
        # Before the hook: init()'s hook, if the script got that far, records it again.
        record_uncaught(getenv(ERROR_FILE_VAR), exc, exc.__traceback__)
        return _uncaught(type(exc), exc, exc.__traceback__)


def _uncaught(*exc_info: Any) -> int:
    """``sys.excepthook`` on an exception that ended the script; 1, or the code of a
    ``SystemExit`` the hook raised (the interpreter exits with it: elastictrain's own
    hook turns a fatal error into 78 that way)."""
    try:
        sys.excepthook(*exc_info)
    except SystemExit as exc:
        return _exit_code(exc.code)
    return 1


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def run(argv: list[str] | None = None) -> NoReturn:
    """``main``, then the standby ends without the interpreter's teardown: nothing in
    it needs one (its workers are processes of their own), and tearing down the
    preloaded torch takes about a second, which the agent's exit, so every run's end,
    would wait for. A forked worker never gets here: its ``SystemExit`` passes through
    and it ends the way a fresh interpreter does (:func:`_child`)."""
    code = main(argv)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
