"""CPU time used by a process and everything it started, read from Linux's ``/proc``.

The agent uses it to tell a worker that is still busy finishing (writing its last
snapshot, in a thread or a child process) from one that is stuck in its exit.
"""

from __future__ import annotations

from elastictrain.core.proc import PROC, stat_fields


def is_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        return stat_fields(pid)[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def tree_cpu_ticks(pids: list[int]) -> dict[int, int | None]:
    """For each of ``pids``: user + system CPU ticks of it and its live descendants
    (their reaped children included); None for a pid that is gone or when ``/proc``
    cannot be read. One walk of ``/proc`` serves every pid.

    The kernel here has no ``/proc/<pid>/task/<tid>/children``, so the trees are found
    from every process's parent pid.
    """
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    try:
        entries = list(PROC.iterdir())
    except OSError:
        return dict.fromkeys(pids)
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            # state, ppid, ... utime, stime, cutime, cstime at offsets 11-14.
            fields = stat_fields(entry.name)
            parent[int(entry.name)] = int(fields[1])
            ticks[int(entry.name)] = sum(int(f) for f in fields[11:15])
        except (OSError, IndexError, ValueError):
            continue  # exited during the walk
    children: dict[int, list[int]] = {}
    for child, ppid in parent.items():
        children.setdefault(ppid, []).append(child)
    return {pid: _tree_total(pid, ticks, children) if pid in ticks else None for pid in pids}


def _tree_total(pid: int, ticks: dict[int, int], children: dict[int, list[int]]) -> int:
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        total += ticks.get(current, 0)
        stack.extend(children.get(current, []))
    return total
