"""When a snapshot is taken: the step and time triggers of both tiers, their automatic
intervals (snapshot/schedule/interval.py) and the marks they count from, and the per-step
agreement that makes every rank decide the same.

Step triggers are deterministic. Clocks, preemption notices, the agent's request for
a save before it restarts the group, the writer's failed persist and its automatic
memory interval differ between ranks: they ride one small all-reduce, on the steps
where one is needed anyway (preemption on, a launcher that may ask for a save, a time
trigger not already due, or an automatic memory interval). The step path stays
collective-free otherwise: the save agrees on a failure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from elastictrain.core.config import SnapshotConfig
from elastictrain.snapshot.schedule.interval import (
    FailureHistory,
    IntervalPolicy,
    failure_history,
    interval_steps,
)
from elastictrain.snapshot.schedule.restart_save import RestartRequest
from elastictrain.worker import preempt
from elastictrain.worker.dist import DistContext


@dataclass(frozen=True)
class Decision:
    """What one step does, the same on every rank."""

    durable: bool  # a durable snapshot is due
    memory: bool  # a memory snapshot is due (never together with a durable one)
    stop: preempt.StopRequest | None  # an agreed preemption notice
    failed_step: int  # the step of a background persist that gave up, or 0
    restart: bool = False  # the agent asked for a save: it restarts the group next


class SaveSchedule:
    """Decides, each step, whether a durable or a memory snapshot is due.

    The marks (the step and time of the last snapshot of each tier) are set here only:
    by ``durable_taken`` (a durable save or a restored step, which both tiers count
    from) and ``memory_taken``.

    Args:
        events_dir: this run's events; its earlier attempts feed the automatic interval.
        clock: monotonic seconds (tests inject a fake one).
        restart: the launcher's request for a save before a restart, if it may ask.
    """

    def __init__(self, config: SnapshotConfig, ctx: DistContext,
                 events_dir: str | None, clock: Callable[[], float],
                 restart: RestartRequest | None = None) -> None:
        self._config, self._ctx, self._clock = config, ctx, clock
        self._restart = restart
        # Whether some rank's launcher may ask for a save before a restart: then every
        # rank votes at every step, one whose launcher cannot ask (its marks refused)
        # too. A node's degraded channel changes its vote, never the collectives it
        # calls (a rank skipping the agreement others call hangs them all).
        asks = int(restart is not None)
        if ctx.initialized and ctx.world_size > 1:
            (asks,) = ctx.all_reduce_max([asks])
        self._restart_voted = bool(asks)
        self._last_save_step, self._last_save_time = 0, clock()
        self._last_memory_step, self._last_memory_time = 0, clock()
        self._unfenced_cost: float | None = None
        # The writer alone chooses an automatic interval; it rides the agreement.
        self.history = (failure_history(events_dir)
                        if ctx.is_writer and (config.auto or self._memory_auto) else None)
        history = self.history
        # With a memory tier, a durable snapshot matters only for the failures that
        # took a node's memory with them: the durable interval counts only those.
        self.durable_policy = (IntervalPolicy(
            config.auto_mtbf_prior_s, config.auto_min_interval_s,
            config.auto_max_interval_s, self._durable_history(history), clock)
            if config.auto and history is not None else None)
        # memory_every="auto": the writer (local rank 0 of its node, so it writes memory
        # snapshots too) measures their cost and votes when one is due.
        self.memory_policy = (IntervalPolicy(
            config.auto_mtbf_prior_s, config.auto_min_interval_s,
            config.auto_max_interval_s, history.memory_view(), clock, tier="memory")
            if self._memory_auto and history is not None else None)

    @property
    def _memory_auto(self) -> bool:
        return self._config.memory_every == "auto"

    def _durable_history(self, history: FailureHistory) -> FailureHistory:
        return history if self._config.memory_every is None else history.durable_view()

    # -- the marks -----------------------------------------------------------------------
    def durable_taken(self, step: int) -> None:
        """A durable snapshot of ``step`` was taken or restored: both tiers' intervals
        count from here (it is newer than any memory snapshot)."""
        self._last_save_step, self._last_save_time = step, self._clock()
        self._last_memory_step, self._last_memory_time = step, self._clock()

    def memory_taken(self, step: int) -> None:
        self._last_memory_step, self._last_memory_time = step, self._clock()

    # -- the costs the automatic intervals weigh ----------------------------------------
    def durable_saved(self, cost_s: float, *, settled_at_fence: bool) -> None:
        """What a durable save cost the loop (back-pressure + staging); with copies
        behind, its cost ends at the fence (``fenced``), which adds the wait there."""
        if self.durable_policy is None:
            return
        if settled_at_fence:
            self._unfenced_cost = cost_s
        else:
            self.durable_policy.observe_cost(cost_s)

    def fenced(self, waited_s: float) -> None:
        """The copies behind are done after ``waited_s`` at the fence."""
        if self.durable_policy is not None and self._unfenced_cost is not None:
            self.durable_policy.observe_cost(self._unfenced_cost + waited_s)
        self._unfenced_cost = None

    def memory_saved(self, cost_s: float) -> None:
        """What a memory snapshot cost the loop (with copies behind: less)."""
        if self.memory_policy is not None:
            self.memory_policy.observe_cost(cost_s)

    def failures_resolved(self, *, memory_kept: bool, rescued: bool) -> None:
        """The failures since the last attempt, now known (after a restore): one the
        memory tier covered leaves the durable interval alone, and a rescued one the
        memory interval too (docs/interval.md)."""
        if self.history is None:
            return
        self.history = self.history.resolved(memory_kept=memory_kept, rescued=rescued)
        if self.durable_policy is not None:
            self.durable_policy.history = self._durable_history(self.history)
        if self.memory_policy is not None:
            self.memory_policy.history = self.history.memory_view()

    # -- the decision --------------------------------------------------------------------
    def decide(self, step: int, failed_step: Callable[[], int],
               watcher: preempt.PreemptionWatcher | None) -> Decision:
        """What ``step`` does, the same on every rank (``failed_step``: this rank's
        contribution to agreeing on a failed persist, asked only when agreeing)."""
        durable, stop, failed, memory_vote, restart = self._agree(step, failed_step, watcher)
        every_memory = self._config.memory_every
        memory = not durable and (memory_vote if every_memory == "auto" else
                                  every_memory is not None and step % every_memory == 0)
        return Decision(durable, memory, stop, failed, restart)

    def _agree(self, step: int, failed_step: Callable[[], int],
               watcher: preempt.PreemptionWatcher | None,
               ) -> tuple[bool, preempt.StopRequest | None, int, bool, bool]:
        every = self._config.every_steps
        due = isinstance(every, int) and step % every == 0
        elapsed: bool | None = None  # None: no time trigger to check at this step
        if (self._config.every_seconds is not None or self._config.auto) and not due:
            elapsed = self._time_due(step)
        restart = self._restart
        if watcher is None and elapsed is None and not self._memory_auto \
                and not self._restart_voted:
            return due, None, 0, False, False
        notice = watcher.flags() if watcher is not None else []
        asked = int(restart is not None and restart.requested())
        agreed = self._ctx.all_reduce_max([int(bool(elapsed)), failed_step(),
                                           int(self._memory_time_due(step)), asked, *notice])
        stop = watcher.agreed(agreed[4:]) if watcher is not None else None
        return due or bool(agreed[0]), stop, agreed[1], bool(agreed[2]), bool(agreed[3])

    def _time_due(self, step: int) -> bool:
        """This rank's vote for a save now: a fixed ``every_seconds`` that elapsed, or
        (the writer only) the automatic interval."""
        since = self._clock() - self._last_save_time
        seconds = self._config.every_seconds
        if isinstance(seconds, float) and since >= seconds:
            return True
        if self.durable_policy is None:
            return False
        steps = step - self._last_save_step
        interval = self.durable_policy.evaluate(step_time_s=since / steps if steps else None)
        if self._config.every_steps == "auto" and steps:
            return steps >= interval_steps(interval, since / steps)
        return since >= interval

    def _memory_time_due(self, step: int) -> bool:
        """The writer's vote for a memory snapshot now (``memory_every="auto"``)."""
        if self.memory_policy is None:
            return False
        steps = step - self._last_memory_step
        since = self._clock() - self._last_memory_time
        step_time = since / steps if steps else None
        interval = self.memory_policy.evaluate(step_time_s=step_time)
        return step_time is not None and steps >= interval_steps(interval, step_time)
