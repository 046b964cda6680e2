"""Reading a process from Linux's ``/proc``: its stat fields and its start time, which
with the pid names one process (a pid alone may be reused). Used by the launcher, the
chaos harness and the event log (a launch id made from torchrun's agent)."""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")


def stat_fields(pid: int | str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (which may hold spaces
    and parentheses): state first, then ppid, ...

    Raises:
        OSError: the process is gone (or ``/proc`` unreadable); IndexError: no fields.
    """
    return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


def start_ticks(pid: int) -> int | None:
    """``pid``'s start time in clock ticks after boot, or None if it is gone."""
    try:
        return int(stat_fields(pid)[19])
    except (OSError, IndexError, ValueError):
        return None
