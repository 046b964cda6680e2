"""What the launcher's exit code means to the user (docs/exit-codes.md), and the lines
that name the first failing worker's error when a run failed."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from elastictrain.core.errors import (
    EXIT_FATAL,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_PREEMPTED_UNSAVED,
    EXIT_USAGE,
    ConfigError,
)

if TYPE_CHECKING:  # the agent imports torch's launcher: only when a run starts
    from elastictrain.launcher.agent import ElasticTrainAgent

# Kept importable for callers of the walking skeleton; the value lives in config.

def launch_meaning(code: int, agent: ElasticTrainAgent | None) -> str:
    """What this launch's exit code means: ``exit_meaning``, unless the rendezvous ended
    it before its workers ever ran (then no restart was used up)."""
    if code != EXIT_OK and agent is not None and agent.rendezvous_error is not None:
        return "failed in the rendezvous, not in the workers"
    return exit_meaning(code)


def usage_error(exc: ConfigError) -> int:
    print(f"elastictrain run: error: {exc}", file=sys.stderr)
    return EXIT_USAGE


def failure_summary(agent: ElasticTrainAgent | None,
                    moved: Callable[[str], str] | None = None) -> list[str]:
    """Lines naming the first failing worker's error of the last failed attempt, its
    log and a fix, and the crash loop if that stopped the run (``elastictrain.runlog.failure``);
    none when no worker reported an error (killed by a signal, preempted). ``moved``
    says where a file named there is now (the launch's files were gathered)."""
    from elastictrain.runlog.failure import failure_lines

    if agent is None:
        return []
    if agent.rendezvous_error is not None:
        return [agent.rendezvous_error]
    loop = agent.settings.crash_loop_failures if agent.outcome == "crash_loop" else None
    failure = agent.failure
    if failure is not None and moved is not None:
        failure = {**failure, **{key: moved(str(failure[key])) for key in
                                 ("output_file", "log_file") if failure.get(key)}}
    return failure_lines(failure, loop)

def outcome_name(code: int) -> str:
    return {EXIT_OK: "finished", EXIT_PREEMPTED: "preempted",
            EXIT_PREEMPTED_UNSAVED: "preempted_unsaved", EXIT_FATAL: "fatal",
            1: "failed"}.get(code, "signalled")


def exit_meaning(code: int) -> str:
    """What the launcher's exit code tells the user (docs/exit-codes.md)."""
    meanings = {
        EXIT_OK: "finished",
        1: "failed: torchrun's restarts are used up; the workers' errors are in their output",
        EXIT_USAGE: "usage error",
        EXIT_PREEMPTED: "stopped after a final snapshot; the same command resumes from it",
        EXIT_PREEMPTED_UNSAVED: "stopped, the final snapshot did not commit; the same "
                                "command resumes from the newest committed one",
        EXIT_FATAL: "fatal, a restart cannot fix it (bad config, resume mismatch, access "
                    "denied, or the same error again and again: a crash loop): see the "
                    "workers' output; do not retry",
    }
    if code in meanings:
        return meanings[code]
    if code - 128 in signal.valid_signals():
        # Not "no final snapshot": a second Ctrl-C during the save ends the launcher
        # with 130 although the workers' snapshot committed (the view shows which).
        return (f"the launcher was stopped by {signal.Signals(code - 128).name}; the same "
                "command resumes from the newest committed snapshot")
    return "failed"
