"""Why a run failed, in a few lines: the first failing worker's error and a fix.

A worker that dies of an uncaught error writes it to torchrun's error file
(``runtime.record_failure``); the agent reads it back, logs it on
``agent.worker_failed`` (``first: true`` for the worker that failed first) and
decides on a crash loop (``agent.crash_loop``). The summaries of ``elastictrain
run`` and ``elastictrain demo`` print these lines from either.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The fields of a worker's error, as written by the worker and logged by the agent.
ERROR_FIELDS = ("error", "message", "where", "failed_step", "log_file")


def fix_line(error: Mapping[str, Any]) -> str:
    """The error's own ``fix:`` (elastictrain's messages carry one), else the general one."""
    message = str(error.get("message") or "")
    if "fix:" in message:
        return message.split("fix:", 1)[1].strip()
    return ("fix the cause above (the worker log has the traceback), then run the same "
            "command: it resumes from the newest committed snapshot")


def failure_lines(error: Mapping[str, Any] | None, crash_loop: int | None = None) -> list[str]:
    """Summary lines for the first failing worker's ``error`` (None: no worker reported
    one, e.g. killed by a signal) and, if the launcher stopped on a crash loop, how many
    identical failures it saw."""
    if not error:
        return []
    # The agent's event says "Type: message"; the worker's own record the message alone.
    message = str(error.get("message") or "").removeprefix(f"{error.get('error')}: ")
    message = message.split("fix:", 1)[0].rstrip(" ;,")
    step = error.get("failed_step")
    lines = [f"  error:           {error.get('error')}: {message}",
             f"    raised at:     {error.get('where')} (rank {error.get('worker_rank')}"
             + (f", step {step})" if step is not None else ")")]
    for label, key in (("worker log", "output_file"), ("worker events", "log_file")):
        if error.get(key):
            lines.append(f"    {label + ':':<15}{error[key]}")
    if crash_loop:
        lines.append(f"  crash loop:      the same error at the same step in {crash_loop} "
                     "attempts in a row; stopped instead of restarting again (exit 78)")
    lines.append(f"  fix:             {fix_line(error)}")
    return lines
