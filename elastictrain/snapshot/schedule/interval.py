"""The automatic snapshot interval (``every_steps="auto"`` / ``every_seconds="auto"``).

Young/Daly: the interval that minimises expected waste is ``sqrt(2 * C * MTBF)``,
with ``C`` the time the training loop loses per snapshot and ``MTBF`` the mean time
between failures. ``C`` is measured by the manager on every save (staging plus any
back-pressure wait for the save before it: what the loop actually waited for).
``MTBF`` is estimated from the run's own history (``failure_history``: earlier
attempts in the events directory, across restarts and relaunches) combined with a
prior, and the uptime of the current attempt. Derivation and simulation:
docs/interval.md and ``scripts/simulate_interval.py``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from elastictrain.core.log import get_logger
from elastictrain.runlog.accounting.attempts import read_attempts

log = get_logger("elastictrain.snapshot")

# A new interval is logged when it moves by more than this fraction.
_LOG_CHANGE = 0.1
# Weight of a new cost measurement in the running estimate of C.
_COST_WEIGHT = 0.3
# The prior on the failure rate is flat in log(rate), for MTBFs within this factor either
# side of auto_mtbf_prior_s (10 s to 15 days at the default): docs/interval.md.
_PRIOR_SPREAD = 360.0
# Points of the log-rate grid that averages the rate before the first failure.
_GRID_POINTS = 240
# Events that end an attempt without losing work: not failures for the MTBF.
_CLEAN_ENDS = frozenset({"run.finished", "preempt.saved"})


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    """The first-order optimal interval between snapshots, in seconds."""
    return math.sqrt(2.0 * max(cost_s, 0.0) * max(mtbf_s, 0.0))


def estimate_mtbf_s(uptime_s: float, failures: int, prior_s: float) -> float:
    """Mean time between failures from observed uptime and failures, with a prior.

    The interval depends on the failure *rate* (the loss per second is rate x half an
    interval), so this is 1 / the posterior mean rate, under a prior flat in log(rate)
    for MTBFs between ``prior_s / _PRIOR_SPREAD`` and ``prior_s * _PRIOR_SPREAD``.
    With failures that is the run's own record, uptime / failures (within those
    bounds). Before the first failure it starts near the short end (a wide prior's mean
    rate is dominated by its fast-failing hypotheses) and grows about as fast as the
    uptime that rules them out (docs/interval.md#the-mtbf-estimate).
    """
    uptime_s = max(uptime_s, 0.0)
    shortest, longest = prior_s / _PRIOR_SPREAD, prior_s * _PRIOR_SPREAD
    if failures > 0:
        return min(max(uptime_s / failures, shortest), longest)
    # Posterior over u = log(rate) with no failure in uptime t: prior flat in u, times
    # the likelihood exp(-rate * t); its mean rate by the trapezoid rule on a grid of u.
    low, high = -math.log(longest), -math.log(shortest)
    weighted_rate = total = 0.0
    for i in range(_GRID_POINTS + 1):
        rate = math.exp(low + (high - low) * i / _GRID_POINTS)
        weight = math.exp(-rate * uptime_s) * (0.5 if i in (0, _GRID_POINTS) else 1.0)
        weighted_rate += weight * rate
        total += weight
    if weighted_rate <= 0.0:  # every hypothesis but the slowest is ruled out
        return longest
    return min(total / weighted_rate, longest)


@dataclass(frozen=True)
class FailureHistory:
    """Uptime and failures of a run's earlier attempts (rank 0's events).

    ``memory_kept`` counts the failures after which every node still held its memory
    tier (the next attempt's ``resume`` event says ``memory_kept``): a memory snapshot
    covers those, so the durable tier's interval leaves them out (``durable_view``).
    ``unresolved``: failures since the last attempt that resumed; the running attempt's
    restore tells whether they kept it (``resolved``).
    """

    uptime_s: float = 0.0
    failures: int = 0
    memory_kept: int = 0
    unresolved: int = 0
    rescued: int = 0  # the next restart resumed a survivor's rescue (snapshot/memory/rescue.py)

    def durable_view(self) -> FailureHistory:
        """The failures only a durable snapshot recovers from (nodes that lost their
        memory; unresolved ones count until resolved)."""
        return FailureHistory(self.uptime_s, self.failures - self.memory_kept)

    def memory_view(self) -> FailureHistory:
        """The failures a periodic memory snapshot is for: those no rescue covered (a
        rescued failure lost nothing, whatever the interval)."""
        return FailureHistory(self.uptime_s, self.failures - self.rescued)

    def resolved(self, *, memory_kept: bool, rescued: bool = False) -> FailureHistory:
        """With the newest failure's outcome known from this attempt's restore."""
        return replace(self, memory_kept=self.memory_kept + self.unresolved * memory_kept,
                       rescued=self.rescued + self.unresolved * rescued, unresolved=0)


def failure_history(events_dir: str | Path | None) -> FailureHistory:
    """Read the earlier attempts of this run from its events directory (rank 0's view;
    the calling process's own attempt, already logged by ``init``, is left out).

    An attempt is one process lifetime (it starts with ``worker.start``); it failed
    unless its last events say it finished or was preempted with a final snapshot. A
    failure kept the memory tier, or was rescued, when the next attempt that resumed
    said so.
    A directory that is missing or unreadable gives an empty history (the prior rules).
    """
    if events_dir is None:
        return FailureHistory()
    attempts = read_attempts(events_dir)
    if attempts and attempts[-1][0].get("pid") == os.getpid():
        attempts.pop()  # this process's own attempt: running, not failed
    uptime, failures, kept, unresolved, rescued = 0.0, 0, 0, 0, 0
    for events in attempts:
        uptime += events[-1]["ts"] - events[0]["ts"]
        resume = next((e for e in events if e.get("event") == "resume"), None)
        if resume is not None:  # settles every failure since the last attempt that resumed
            kept += unresolved if resume.get("memory_kept") is True else 0
            rescued += unresolved if resume.get("rescued") is True else 0
            unresolved = 0
        if not any(e.get("event") in _CLEAN_ENDS for e in events):
            failures += 1
            unresolved += 1
    return FailureHistory(uptime, failures, kept, unresolved, rescued)


class IntervalPolicy:
    """The automatic interval of one attempt, re-evaluated as C and MTBF change.

    Args:
        prior_mtbf_s: MTBF assumed before the run has a record of its own.
        min_s / max_s: bounds on the interval.
        history: the earlier attempts' uptime and failures.
        clock: monotonic seconds (injected in tests).
        tier: the tier whose snapshots it spaces (``durable`` or ``memory``), logged.
    """

    def __init__(self, prior_mtbf_s: float, min_s: float, max_s: float,
                 history: FailureHistory, clock: Callable[[], float],
                 tier: str = "durable") -> None:
        self.prior_mtbf_s, self.min_s, self.max_s = prior_mtbf_s, min_s, max_s
        self.tier = tier
        self.history = history
        self._clock = clock
        self._started = clock()
        self.cost_s: float | None = None
        self.interval_s = min_s  # until a cost is measured: snapshot early, to measure it
        self._logged: float | None = None
        self._mtbf: tuple[FailureHistory, float, float] | None = None  # (for, at uptime, MTBF)

    def observe_cost(self, cost_s: float) -> None:
        """Record what one snapshot cost the training loop, in seconds."""
        self.cost_s = cost_s if self.cost_s is None else (
            (1 - _COST_WEIGHT) * self.cost_s + _COST_WEIGHT * cost_s)

    def mtbf_s(self) -> float:
        """The estimate now; recomputed once the uptime has grown by 1% (it is asked
        every step, and the estimate moves with the uptime no faster than that)."""
        history = self.history
        uptime = history.uptime_s + (self._clock() - self._started)
        cached = self._mtbf
        if cached is None or cached[0] != history or not cached[1] <= uptime <= 1.01 * cached[1]:
            cached = (history, uptime,
                      estimate_mtbf_s(uptime, history.failures, self.prior_mtbf_s))
            self._mtbf = cached
        return cached[2]

    def evaluate(self, step_time_s: float | None = None) -> float:
        """The interval now, in seconds; logged as ``snapshot.interval`` when it moves.

        Args:
            step_time_s: seconds per step, to report the interval in steps too.
        """
        mtbf = self.mtbf_s()
        if self.cost_s is None:
            interval, reason = self.min_s, "no_cost_yet"
        else:
            optimum = young_daly_s(self.cost_s, mtbf)
            interval = min(max(optimum, self.min_s), self.max_s)
            reason = ("young_daly" if interval == optimum
                      else "min_bound" if interval == self.min_s else "max_bound")
        self.interval_s = interval
        if self._logged is None or abs(interval - self._logged) > _LOG_CHANGE * self._logged:
            self._logged = interval
            steps = interval_steps(interval, step_time_s) if step_time_s else None
            log.info("snapshot.interval", interval_s=round(interval, 3), interval_steps=steps,
                     cost_s=None if self.cost_s is None else round(self.cost_s, 4),
                     mtbf_s=round(mtbf, 1), failures=self.history.failures,
                     reason=reason, tier=self.tier)
        return interval


def interval_steps(interval_s: float, step_time_s: float) -> int:
    """An interval in seconds as a whole number of steps (at least one)."""
    return max(1, round(interval_s / step_time_s))
