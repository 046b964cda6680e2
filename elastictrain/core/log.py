"""Structured logging: events with fields, one JSON object per line off a TTY.

Every event carries run_id, rank, world_size, restart_count and step, bound
once through structlog's contextvars (step is re-bound as training advances).
Events can also be appended to a JSON-lines file per worker (the run's event
log); reading it back is ``elastictrain.runlog.events_read``'s job.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Protocol

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from elastictrain.core.localfiles import make_private_dirs, private_opener

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


class Uploader(Protocol):
    """Copies an event file to the run's storage (``elastictrain.runlog.events.Uploader``)."""

    def maybe_upload(self, path: Path) -> None: ...

    def close(self, path: Path) -> None: ...


class _EventFileTee:
    """Processor that appends each event as a JSON line to a file, then passes it on;
    with an uploader (object storage), the file is also copied to the run's storage."""

    def __init__(self, path: Path, upload: Uploader | None = None) -> None:
        make_private_dirs(path.parent)
        self._path = path
        self._file: IO[str] = open(path, "a", encoding="utf-8", buffering=1,  # noqa: SIM115
                                   opener=private_opener)
        self._lock = threading.Lock()
        self._upload = upload

    @property
    def path(self) -> Path:
        return self._path

    def __call__(self, logger: WrappedLogger, name: str, event: EventDict) -> EventDict:
        line = json.dumps(event, default=str, separators=(",", ":"))
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")
        if self._upload is not None:
            self._upload.maybe_upload(self._path)
        return event

    def close(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._file.close()
        if self._upload is not None:
            self._upload.close(self._path)


_tee: _EventFileTee | None = None


@atexit.register
def _close_tee() -> None:
    # The last events of a process (exit 75 after the final snapshot…) reach object
    # storage here; a SIGKILLed process keeps what its last periodic upload carried.
    if _tee is not None:
        _tee.close()


def move_events_file(path: str | Path, upload: Uploader | None = None,
                     *, leave_link: bool = False) -> None:
    """Move this process's event file to ``path`` and go on appending there.

    What was written so far is copied to the new file first, so it still starts with
    the process's first event (``worker.start``); the old file is removed, or with
    ``leave_link`` replaced by a symbolic link to the new one (a launcher that watches
    the old directory still reads it). Nothing happens without an event file.
    """
    global _tee
    old = _tee
    if old is None:
        return
    new = Path(path)
    old.close()  # on object storage this also uploads it once more: harmless
    if old.path != new:
        make_private_dirs(new.parent)
        try:
            written = old.path.read_bytes()
            old.path.unlink()
        except OSError:
            written = b""
        with open(new, "ab", opener=private_opener) as f:  # 0600, as every event file
            f.write(written)
        if leave_link:
            with contextlib.suppress(OSError):
                old.path.symlink_to(new.resolve())
    _tee = _EventFileTee(new, upload)
    config = structlog.get_config()
    processors = [_tee if p is old else p for p in config["processors"]]
    structlog.configure(processors=processors)


def events_file() -> Path | None:
    """This process's event file (None without one)."""
    return _tee.path if _tee is not None else None


def _add_time(logger: WrappedLogger, name: str, event: EventDict) -> EventDict:
    event.setdefault("ts", round(time.time(), 6))
    return event


def _clock_time(logger: WrappedLogger, name: str, event: EventDict) -> EventDict:
    """For a reader (console rendering only; the event files keep epoch seconds): the
    event's time as 14:03:07.123 in local time, first on its line."""
    ts = event.get("ts")
    if isinstance(ts, (int, float)):
        event["ts"] = time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts % 1 * 1000):03d}"
    return event


def configure(
    level: str = "info",
    *, json_output: bool | None = None,
    events_file: str | Path | None = None,
    stream: IO[str] | None = None,
    upload: Uploader | None = None,
) -> None:
    """Set up structlog for this process.

    Args:
        level: minimum level written to ``stream``.
        json_output: JSON lines when True, console rendering when False;
            None picks JSON unless ``stream`` is a TTY.
        events_file: if given, every event is also appended there as JSON.
        upload: copies ``events_file`` to object storage (``elastictrain.runlog.events``).
        stream: where rendered events go (default stderr, so stdout stays
            free for command output such as ``--json``).
    """
    global _tee
    stream = stream or sys.stderr
    if json_output is None:
        json_output = not stream.isatty()
    if _tee is not None:
        _tee.close()
        _tee = None
    processors: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _add_time,
    ]
    if events_file is not None:
        _tee = _EventFileTee(Path(events_file), upload)
        processors.append(_tee)
    processors.append(structlog.processors.format_exc_info)
    if json_output:
        processors.append(structlog.processors.JSONRenderer(default=str))
    else:
        processors += [_clock_time, structlog.dev.ConsoleRenderer(colors=False,
                                                                  timestamp_key="ts")]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        # One write() per event, line and newline together: print() writes them
        # separately, and on an unbuffered stream (PYTHONUNBUFFERED, as under torchrun)
        # ranks sharing one stdout then interleave into "}{" lines.
        logger_factory=structlog.WriteLoggerFactory(file=stream),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )


def configure_forwarding(send: Callable[[dict[str, Any]], None], level: str = "debug") -> None:
    """Hand every event of this process to ``send`` instead of writing it.

    A helper process (the snapshot persister) forwards its events to its worker,
    which logs them with the worker's bound context (``log_forwarded``), so the
    run's event log stays one file per worker.
    """

    def forward(logger: WrappedLogger, name: str, event: EventDict) -> EventDict:
        send({k: v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
              for k, v in event.items()})
        raise structlog.DropEvent

    structlog.configure(
        processors=[structlog.processors.add_log_level, _add_time, forward],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.WriteLoggerFactory(),
        cache_logger_on_first_use=False,
    )


def log_forwarded(event: dict[str, Any], logger_name: str = "elastictrain") -> None:
    """Log an event received from a helper process (its ``ts`` and level are kept)."""
    fields = dict(event)
    level = str(fields.pop("level", "info"))
    name = fields.pop("event", "unknown")
    method = getattr(get_logger(logger_name), level, None) or get_logger(logger_name).info
    method(name, **fields)


def bind(**fields: Any) -> None:
    """Bind fields (run_id, rank, world_size, restart_count, step…) to every later event."""
    structlog.contextvars.bind_contextvars(**fields)


def bind_step(step: int) -> None:
    """Re-bind the current training step."""
    structlog.contextvars.bind_contextvars(step=step)


def get_logger(name: str | None = None) -> Any:
    """A structlog logger; call as ``log.info("snapshot.committed", step=…)``."""
    return structlog.get_logger(name) if name else structlog.get_logger()
