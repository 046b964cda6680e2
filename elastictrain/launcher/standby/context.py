"""torchrun's worker bookkeeping, with workers forked by the standby instead of ``Popen``.

torchrun's agent starts its workers through ``start_processes``, which builds a
``SubprocessContext`` of one ``SubprocessHandler`` (a ``Popen``) per local rank.
:class:`StandbyContext` is that context with :class:`StandbyHandler` in place of
the handler, and :func:`start_processes_with` is the ``start_processes`` the agent
uses while it starts a worker group (installed by ``launcher/torch_hooks.py``): log
files, tee, error files, failure reports and the stop signals stay torchrun's own.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.elastic.multiprocessing.api import PContext, SubprocessContext

from elastictrain.launcher.standby.client import (
    Standby,
    StandbyProcess,
    StandbyUnavailable,
    signal_worker,
)

OnStart = Callable[[bool, "str | None"], None]  # (forked, why not)

# What SubprocessContext takes of start_processes' arguments (start_method is for
# function entry points only).
_CONTEXT_ARGS = ("name", "entrypoint", "args", "envs", "logs_specs", "log_line_prefixes",
                 "numa_options", "duplicate_stdout_filters", "duplicate_stderr_filters")


def python_argv(entrypoint: object, args: Sequence[object]) -> list[str] | None:
    """``args`` when torchrun asks for ``python -u SCRIPT ...`` or ``python -u -m MODULE
    ...`` (what the standby can run); None for anything else (``--no-python``,
    ``--run-path``, another interpreter)."""
    argv = [str(a) for a in args]
    if entrypoint != sys.executable or len(argv) < 2 or argv[0] != "-u":
        return None
    if argv[1] == "-m":
        return argv if len(argv) >= 3 else None
    return None if argv[1].startswith("-") else argv


class StandbyHandler:
    """One worker forked by the standby, shaped as torchrun's ``SubprocessHandler``."""

    def __init__(self, proc: StandbyProcess, local_rank_id: int) -> None:
        self.proc = proc
        self.local_rank_id = local_rank_id

    def close(self, death_sig: signal.Signals | None = None) -> None:
        # Not once it is known to have ended: its pid may be another process's by now.
        if self.proc.poll() is not None:
            return
        signal_worker(self.proc.pid, death_sig or signal.SIGTERM)


class StandbyContext(SubprocessContext):
    """torchrun's ``SubprocessContext`` whose workers the standby forks."""

    def __init__(self, standby: Standby, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._standby = standby
        self.forked = False  # True once the standby started the whole group

    def _start(self) -> None:
        handlers: dict[int, StandbyHandler] = {}
        try:
            for local_rank in range(self.nprocs):
                env = {**os.environ, **self.envs[local_rank]}
                proc = self._standby.spawn([str(a) for a in self.args[local_rank]], env,
                                           self.stdouts[local_rank] or None,
                                           self.stderrs[local_rank] or None)
                handlers[local_rank] = StandbyHandler(proc, local_rank)
        except StandbyUnavailable:
            # Lost mid-group: stop what it started and start the whole group with Popen.
            self._stop(handlers)
            super()._start()
            return
        except BaseException:
            # A notice mid-group (torchrun's SignalException): the context never held
            # these workers, so its close() would not stop them.
            self._stop(handlers)
            raise
        self.subprocess_handlers = handlers  # type: ignore[assignment]
        self.forked = True

    @staticmethod
    def _stop(handlers: dict[int, StandbyHandler]) -> None:
        for handler in handlers.values():
            handler.close(signal.SIGKILL)
            handler.proc.wait()


def start_processes_with(standby: Standby, original: Callable[..., PContext],
                         on_start: OnStart) -> Callable[..., PContext]:
    """A ``start_processes`` that forks Python workers from ``standby`` and leaves the
    rest to ``original``; ``on_start(forked, why_not)`` says which started the group."""

    def start(**kwargs: Any) -> PContext:
        why_not = None
        if kwargs.get("numa_options"):
            why_not = "NUMA binding wraps the command"
        elif not all(python_argv(kwargs["entrypoint"], a) is not None
                     for a in kwargs["args"].values()):
            why_not = "the command is not `python -u SCRIPT` or `python -u -m MODULE`"
        elif not standby.ready():
            why_not = str(standby.info.get("reason"))
        if why_not is not None:
            on_start(False, why_not)
            return original(**kwargs)
        context = StandbyContext(standby, **{k: kwargs[k] for k in _CONTEXT_ARGS if k in kwargs})
        try:
            context.start()
        except Exception:
            context.close()
            raise
        on_start(context.forked, None if context.forked else "the standby stopped answering")
        return context

    return start
