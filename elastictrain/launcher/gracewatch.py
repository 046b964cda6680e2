"""The launcher ends within its grace period after a notice, whatever it is waiting in.

torchrun's agent acts on SIGTERM in a Python signal handler, which runs only when its
main thread is back in Python. Blocked in a C++ store call (the exit barrier after a
finished run waits up to 300 s for the other nodes, a rendezvous for a node that is
gone), it would outlive a scheduler's grace period. A signal's C handler also writes
its number to the wakeup descriptor at once; a thread waiting on that descriptor starts
the countdown, and when the grace runs out with the launcher still there it SIGKILLs
the workers' process groups and the standby and exits: 75 if the workers' final
snapshot committed, else 128 + the signal's number, as a launcher killed by it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from elastictrain.core.log import get_logger

log = get_logger("elastictrain.agent")


@contextmanager
def watching(grace_s: float, notices: frozenset[int],
             on_expire: Callable[[int], tuple[list[int], int]]) -> Iterator[None]:
    """While the block runs (in the main thread), a notice among ``notices`` starts a
    countdown of ``grace_s``; at its end ``on_expire(signum)`` returns the process
    groups to SIGKILL and the exit code, and the process exits with it."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            notice = next((n for n in data if n in notices), None)
            if notice is None:
                continue
            if done.wait(grace_s):
                return
            groups, code = on_expire(notice)
            log.error("agent.grace_expired", signal=signal.Signals(notice).name,
                      grace_s=grace_s, killed_groups=groups, exit_code=code)
            for group in groups:
                with contextlib.suppress(OSError):
                    os.killpg(group, signal.SIGKILL)
            os._exit(code)

    thread = threading.Thread(target=watch, name="elastictrain-grace", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(previous)
        os.close(write_fd)  # the watcher's read returns (end of file) and it ends
        thread.join(timeout=5)
        os.close(read_fd)
