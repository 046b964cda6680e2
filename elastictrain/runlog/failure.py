"""Why a run failed, in a few lines: the first failing worker's error and a fix.

A worker that dies of an uncaught error writes it to torchrun's error file
(``runtime.record_failure``); the agent reads it back, logs it on
``agent.worker_failed`` (``first: true`` for the worker that failed first) and
decides on a crash loop (``agent.crash_loop``). The summaries of ``elastictrain
run`` and ``elastictrain demo`` print these lines from either.

A worker that dies before ``elastictrain.init()`` (an import, a typo, a missing
file) has no hook of ours yet: a worker forked from the launcher's standby records
it all the same (:func:`record_uncaught`), and for any other the agent reads the end
of the output file torchrun sent its stderr to; :func:`error_from_output` makes the
same fields of the traceback (``before_init``: true, no step).
"""

from __future__ import annotations

import json
import os
import re
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

# The fields of a worker's error, as written by the worker and logged by the agent.
ERROR_FIELDS = ("error", "message", "where", "failed_step", "log_file", "traceback",
                "before_init")
TRACEBACK_START = "Traceback (most recent call last):"
_FRAME = re.compile(r'^\s+File "(?P<file>.+)", line (?P<line>\d+)')
_EXCEPTION = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?::\s?(?P<message>.*))?$")
TRACEBACK_SHOWN = 4  # lines of a traceback's end in the view and the summary
OUTPUT_TAIL_BYTES = 64_000  # how much of a worker's output end is read for its traceback


def traceback_tail(lines: Sequence[str]) -> list[str]:
    """The end of a formatted traceback worth showing: the innermost frame (where, and
    its source line) and the exception line, at most ``TRACEBACK_SHOWN`` lines."""
    lines = [line.rstrip() for line in lines if line.strip()]
    frames = [i for i, line in enumerate(lines) if _FRAME.match(line)]
    start = frames[-1] if frames else max(0, len(lines) - 1)
    shown = [line for line in lines[start:] if not set(line.strip()) <= set("^~ ")]
    return shown[:TRACEBACK_SHOWN]


def error_from_output(text: str) -> dict[str, Any] | None:
    """The error of a worker that died of an uncaught exception, from the end of its
    output (stderr): the last traceback's type, message, innermost place and its last
    lines; None when the output ends without one (killed, or exited on its own)."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(TRACEBACK_START)]
    if not starts:
        return None
    block = lines[starts[-1] + 1:]
    frames = [i for i, line in enumerate(block) if _FRAME.match(line)]
    if not frames:
        return None
    last = block[frames[-1]:]
    # The exception line: the first unindented line after the innermost frame.
    found = next((i for i, line in enumerate(last) if line and not line[0].isspace()), None)
    if found is None:
        return None
    matched = _EXCEPTION.match(last[found])
    if matched is None:
        return None
    frame = _FRAME.match(last[0])
    assert frame is not None
    return {"error": matched["type"].rsplit(".", 1)[-1],
            "message": (matched["message"] or "").strip()[:2000],
            "where": f"{frame['file']}:{frame['line']}",
            "failed_step": None, "before_init": True,
            "traceback": traceback_tail(last[:found + 1])}


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
    when = f", step {step}" if step is not None else \
        ", before elastictrain.init()" if error.get("before_init") else ""
    lines = [f"  error:           {error.get('error')}: {message}",
             f"    raised at:     {error.get('where')} (rank {error.get('worker_rank')}{when})"]
    # The innermost frame and its source line (the exception line is the one above).
    lines += [f"{'':19}{line.rstrip()}" for line in list(error.get("traceback") or [])[:-1]]
    if "output_file" in error and not error["output_file"]:  # the agent found no file
        lines.append("    worker log:    not in a file: the worker wrote to the launcher's "
                     "stderr (above)")
    for label, key in (("worker log", "output_file"), ("worker events", "log_file")):
        if error.get(key):
            lines.append(f"    {label + ':':<15}{error[key]}")
    if crash_loop:
        at = "place before any step" if error.get("before_init") else "step"
        lines.append(f"  crash loop:      the same error at the same {at} in {crash_loop} "
                     "attempts in a row; stopped instead of restarting again (exit 78)")
    lines.append(f"  fix:             {fix_line(error)}")
    return lines


def error_from_output_file(path: str) -> dict[str, Any] | None:
    """:func:`error_from_output` of the last ``OUTPUT_TAIL_BYTES`` of a worker's output
    file (None when it cannot be read)."""
    try:
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            file.seek(max(0, file.tell() - OUTPUT_TAIL_BYTES))
            text = file.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    return error_from_output(text)


def write_error_file(path: str, failure: Mapping[str, Any], stack: str) -> None:
    """Write ``failure`` to torchrun's error file of this worker (``path``), in torch's
    own format (its ``message``; torchrun's failure report prints ``py_callstack``)
    plus ours under ``elastictrain`` (the agent reads it). Whole or absent, never
    torn: the agent reads it once the process exits, and a kill during the write would
    otherwise leave it half written. Best effort: the exit must still happen."""
    headline = f"{failure['error']}: {failure['message']}"
    data = {"message": {"message": headline,
                        "extraInfo": {"py_callstack": stack,
                                      "timestamp": str(int(time.time()))}},
            "elastictrain": {**failure, "ts": time.time()}}
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        partial = Path(f"{path}.{os.getpid()}.partial")
        partial.write_text(json.dumps(data, default=str), encoding="utf-8")
        partial.replace(path)
    except OSError:
        pass


def record_uncaught(path: str | None, exc: BaseException, tb: TracebackType | None) -> None:
    """A script's uncaught exception, before any hook of ``elastictrain.init()`` ran, to
    the error file ``path`` (none: not under torchrun): the agent then names it in the
    view and the summary, and counts it for a crash loop. ``init()``'s own hook, when it
    runs after this, writes the file again with what it knows (the step)."""
    if not path:
        return
    stack = "".join(traceback.format_exception(type(exc), exc, tb))
    failure = error_from_output(stack)
    if failure is not None:
        write_error_file(path, failure, stack)
