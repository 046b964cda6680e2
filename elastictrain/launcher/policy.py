"""What the launcher's agent does about what its workers did: the failure policy.

Pure: a function of what the agent saw (exit codes, the marks workers leave, CPU ticks,
elapsed time, the errors the workers reported) to what it does (keep watching, stop the
survivors of a failure, count the group as finished, stop as preempted, fatal or a crash
loop, restart, wait for a rescue or a save). No process, clock, file or torch object is
touched here: ``agent.py`` gathers the facts and carries the decisions out, so every rule
is tested against a table of cases (tests/unit/launcher/test_policy.py).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from elastictrain.core.errors import (
    EXIT_FATAL,
    EXIT_HANG,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_PREEMPTED_UNSAVED,
)

PREEMPTED = (EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED)  # the group agreed to stop: no restart
# Errors a worker raises for a fault outside its script (errors.PeerNodeLost): never a
# crash loop, however often they repeat.
EXTERNAL_ERRORS = frozenset({"PeerNodeLost"})


def preempted_outcome(codes: Iterable[int | None]) -> str | None:
    """``preempted`` (75), ``preempted_unsaved`` (76: any rank says the final snapshot
    did not commit) or None, from the workers' exit codes."""
    seen = set(codes)
    if EXIT_PREEMPTED_UNSAVED in seen:
        return "preempted_unsaved"
    return "preempted" if EXIT_PREEMPTED in seen else None


def describe_exit(exitcode: int) -> str:
    """What a worker's exit code means to the launcher."""
    if exitcode in PREEMPTED:
        return str(preempted_outcome([exitcode]))
    if exitcode == EXIT_FATAL:
        return "fatal"
    if exitcode == EXIT_HANG:
        return "hang"
    return "signal" if exitcode < 0 else "error"


@dataclass(frozen=True)
class Workers:
    """The current attempt's workers at one look: pid -> exit code (None while
    running), and the pids that marked the run's agreed end (``runend``)."""

    codes: Mapping[int, int | None]
    ended: Collection[int] = frozenset()

    @property
    def running(self) -> list[int]:
        return sorted(pid for pid, code in self.codes.items() if code is None)

    @property
    def failed(self) -> dict[int, int]:
        return {pid: code for pid, code in self.codes.items() if code not in (None, 0)}

    @property
    def failed_before_the_end(self) -> dict[int, int]:
        """The failed workers that had not marked the run's agreed end: a failure of the
        run (one past the end fails no run: ``after_the_end``)."""
        return {pid: code for pid, code in self.failed.items() if pid not in self.ended}

    def finished(self) -> bool:
        """Every worker ended the run: exit 0, or past the agreed end (a notice while the
        agent waits for the other nodes, or while a script works on after ``close()``, is
        then no failure)."""
        return bool(self.codes) and all(code == 0 or pid in self.ended
                                        for pid, code in self.codes.items())

    def past_the_end(self) -> bool:
        """A worker of this node marked the run's agreed end: every rank reached it."""
        return any(pid in self.ended for pid in self.codes)


class AfterEnd(Enum):
    """A failure after every rank agreed the run's end: no restart of a finished run."""

    WAIT = "wait"  # its peers here are left to finish (rank 0 may still write files)
    SUCCEEDED = "succeeded"  # all done: the group counts as succeeded


def after_the_end(workers: Workers) -> AfterEnd | None:
    """None while no worker failed, or one failed before the agreed end (the usual
    handling applies)."""
    failed = workers.failed
    if not failed or not all(pid in workers.ended for pid in failed):
        return None
    return AfterEnd.WAIT if workers.running else AfterEnd.SUCCEEDED


def survivors_to_stop(workers: Workers) -> list[int]:
    """The running workers to SIGKILL once one failed, before torchrun's poll would
    SIGTERM them (they read SIGTERM as a preemption notice); none after a 75/76 (the
    others are finishing a final save), or after one past the run's agreed end (its
    peers here are left to finish)."""
    failed = workers.failed_before_the_end
    if not failed or preempted_outcome(failed.values()) is not None:
        return []
    return workers.running


def rescue_wait_over(busy: Collection[int], unstarted: Collection[int], elapsed_s: float,
                     timeout_s: float, start_timeout_s: float) -> bool:
    """Whether the agent stops waiting for survivors writing a rescue (``busy``: at most
    ``timeout_s``) or armed for one that have not begun (``unstarted``: their peer's death
    reaches them through a collective, a moment after the agent saw it; at most
    ``start_timeout_s``)."""
    return not ((busy and elapsed_s < timeout_s)
                or (unstarted and elapsed_s < start_timeout_s))


def save_wait_over(listening: Collection[int], ready: Collection[int],
                   rescuing: Collection[int], elapsed_s: float, timeout_s: float) -> bool:
    """Before a membership-change restart: whether every running worker that listens is
    ready (saved, or closing, or taking no step) and none writes a rescue; or the wait
    ran ``timeout_s``."""
    return (set(ready) >= set(listening) and not rescuing) or elapsed_s >= timeout_s


def restart_reason(*, group_healthy: bool) -> str:
    """torchrun restarts a healthy group only when a node waits to join."""
    return "membership_change" if group_healthy else "failure"


@dataclass
class ExitWatch:
    """Workers stuck in their exit: once a peer exited 0, one whose process tree used
    no CPU for ``timeout_s`` (stopped, or deadlocked in a destructor) is to be killed.
    CPU time, not wall time: rank 0 may still write the final snapshot after its peers
    exited. Its state: pid -> (CPU ticks, since when)."""

    timeout_s: float
    seen: dict[int, tuple[int | None, float]] = field(default_factory=dict)

    def stuck(self, workers: Workers, ticks: Mapping[int, int | None], now: float) -> list[int]:
        if 0 not in workers.codes.values() or not workers.running:
            return []
        found = []
        for pid in workers.running:
            if pid not in ticks:  # gone between the poll and the read: not stuck
                continue
            tick = ticks[pid]
            before = self.seen.get(pid)
            if before is None or before[0] != tick:
                self.seen[pid] = (tick, now)
            elif now - before[1] >= self.timeout_s:
                found.append(pid)
        return found

    def reset(self) -> None:
        self.seen.clear()


def crash_signature(error: Mapping[str, Any] | None) -> tuple[str, ...] | None:
    """What must repeat for a crash loop: the error's type, message, place and step; for
    one before ``init()`` (read from the worker's output: ``before_init``, no step
    reached) its type and place only, as its message may name passing details (a
    port, a pid). None for no error, or one that is not the script's."""
    if error is None or error.get("error") in EXTERNAL_ERRORS:
        return None
    if error.get("before_init"):
        return (str(error.get("error")), str(error.get("where")), "before init")
    return tuple(str(error.get(k)) for k in ("error", "message", "where", "failed_step"))


@dataclass
class CrashLoop:
    """Identical failures in a row: the first failing worker's error (type, message,
    place, step; before ``init()``: type and place) repeated ``limit`` times means no
    progress. A failure at another step, another error, a failure without a reported
    error (a signal) or the loss of another node (``EXTERNAL_ERRORS``: the fleet's
    fault, not the script's) starts over."""

    limit: int
    signature: tuple[str, ...] | None = None
    count: int = 0

    def record(self, error: Mapping[str, Any] | None) -> bool:
        """Count one failed attempt; True when the run is to stop as a crash loop."""
        signature = crash_signature(error)
        if signature is not None and signature == self.signature:
            self.count += 1
        else:
            self.signature, self.count = signature, int(signature is not None)
        return error is not None and bool(self.limit) and self.count >= self.limit


class Verdict(Enum):
    """What a failed attempt leads to."""

    RESTART = "restart"
    PREEMPTED = "preempted"  # 75: the final snapshot committed; no restart
    PREEMPTED_UNSAVED = "preempted_unsaved"  # 76: the final snapshot did not commit
    FATAL = "fatal"  # 78 from a worker: a restart cannot fix it
    CRASH_LOOP = "crash_loop"  # the same error at the same step, attempt after attempt


def first_failure(errors: Mapping[int, Mapping[str, Any] | None]) -> int | None:
    """The rank whose reported error came first (by its time, then rank): it says why;
    the others mostly failed because it did. None when none reported one."""
    reported = {rank: e for rank, e in errors.items() if e is not None}
    return min(reported, key=lambda r: (float(reported[r].get("ts") or 0.0), r),
               default=None)


def on_failures(codes: Iterable[int], first_error: Mapping[str, Any] | None,
                loop: CrashLoop) -> Verdict:
    """A failed attempt: a 75/76 means the whole world agreed to stop (workers pass a
    barrier first), a 78 cannot be healed by a restart, a crash loop stops the run;
    anything else restarts (torchrun counts the restarts)."""
    preempted = preempted_outcome(codes)
    if preempted is not None:
        return Verdict(preempted)
    if EXIT_FATAL in set(codes):
        return Verdict.FATAL
    return Verdict.CRASH_LOOP if loop.record(first_error) else Verdict.RESTART


def outcome_exit_code(outcome: str | None, signum: int) -> int:
    """The launcher's exit code when a signal ended it: 75/76 when the workers settled
    their final snapshot, else that of a process killed by ``signum``."""
    return {"preempted": EXIT_PREEMPTED,
            "preempted_unsaved": EXIT_PREEMPTED_UNSAVED}.get(str(outcome), 128 + signum)


def signalled_exit_code(workers: Workers, outcome: str | None, signum: int) -> int:
    """A signal ended the launcher: 0 when this node's workers had all ended the run (it
    waited for the other nodes), else ``outcome_exit_code`` of what they reported."""
    if workers.finished():
        return EXIT_OK
    return outcome_exit_code(preempted_outcome(workers.codes.values()) or outcome, signum)
