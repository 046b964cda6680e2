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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elastictrain.accounting.attempts import read_attempts
from elastictrain.log import get_logger

log = get_logger("elastictrain.snapshot")

# A new interval is logged when it moves by more than this fraction.
_LOG_CHANGE = 0.1
# Weight of a new cost measurement in the running estimate of C.
_COST_WEIGHT = 0.3
# How many failures' worth of evidence the MTBF prior counts for once failures are seen.
_PRIOR_WEIGHT = 0.2
# Events that end an attempt without losing work: not failures for the MTBF.
_CLEAN_ENDS = frozenset({"run.finished", "preempt.saved"})


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    """The first-order optimal interval between snapshots, in seconds."""
    return math.sqrt(2.0 * max(cost_s, 0.0) * max(mtbf_s, 0.0))


def estimate_mtbf_s(uptime_s: float, failures: int, prior_s: float) -> float:
    """Mean time between failures from observed uptime and failures, with a prior.

    Before the first failure: the prior, or the uptime so far when that is longer (a
    run that has not failed for that long has at least that MTBF). After failures: the
    posterior mean of a Gamma prior on the failure rate worth ``_PRIOR_WEIGHT`` of a
    failure, so the run's own record soon dominates (docs/interval.md).
    """
    uptime_s = max(uptime_s, 0.0)
    if failures == 0:
        return max(prior_s, uptime_s)
    return (_PRIOR_WEIGHT * prior_s + uptime_s) / (_PRIOR_WEIGHT + failures)


@dataclass(frozen=True)
class FailureHistory:
    """Uptime and failures of a run's earlier attempts (rank 0's events)."""

    uptime_s: float = 0.0
    failures: int = 0


def failure_history(events_dir: str | Path | None) -> FailureHistory:
    """Read the earlier attempts of this run from its events directory.

    An attempt is one process lifetime (it starts with ``worker.start``); it failed
    unless its last events say it finished or was preempted with a final snapshot.
    A directory that is missing or unreadable gives an empty history (the prior rules).
    """
    if events_dir is None:
        return FailureHistory()
    uptime, failures = 0.0, 0
    for events in read_attempts(events_dir):
        uptime += events[-1]["ts"] - events[0]["ts"]
        if not any(e.get("event") in _CLEAN_ENDS for e in events):
            failures += 1
    return FailureHistory(uptime, failures)


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

    def observe_cost(self, cost_s: float) -> None:
        """Record what one snapshot cost the training loop, in seconds."""
        self.cost_s = cost_s if self.cost_s is None else (
            (1 - _COST_WEIGHT) * self.cost_s + _COST_WEIGHT * cost_s)

    def mtbf_s(self) -> float:
        uptime = self.history.uptime_s + (self._clock() - self._started)
        return estimate_mtbf_s(uptime, self.history.failures, self.prior_mtbf_s)

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
