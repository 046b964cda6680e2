"""The final snapshot on an agreed preemption notice (``elastictrain.worker.preempt``), then
the exit of every rank: 75 if it committed, 76 if not."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NoReturn

from elastictrain.core.errors import EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED
from elastictrain.core.log import get_logger
from elastictrain.snapshot.durable.saver_interface import SnapshotSaver
from elastictrain.worker import preempt, watchdog
from elastictrain.worker.dist import DistContext

log = get_logger("elastictrain.snapshot")


def pending_stop(watcher: preempt.PreemptionWatcher | None,
                 ctx: DistContext) -> preempt.StopRequest | None:
    """A preemption notice on any rank, agreed now (every rank calls it together)."""
    if watcher is None:
        return None
    return watcher.agreed(ctx.all_reduce_max(watcher.flags()))


def save_and_exit(stop: preempt.StopRequest, ctx: DistContext, saver: SnapshotSaver,
                  *, persists_here: bool, save_final: Callable[[], object],
                  step: int) -> NoReturn:
    """Final snapshot of ``step``, then exit on every rank (``preempt.saved`` or
    ``preempt.failed`` says which code).

    The save in flight commits first; its failure is logged and the final save is
    attempted anyway. The ranks then gather the writer's outcome, which also keeps
    every rank alive until the writer is done (the agent tears the group down as soon
    as one rank exits).

    Args:
        persists_here: this rank persists (the writer, or every rank when sharded).
        save_final: the final save, made so that nothing may drop it (no copy behind).
    """
    started = time.monotonic()
    saver.hurry()  # the time left counts now, not the loop's rate
    if persists_here:
        try:
            saver.wait()
        except Exception as exc:  # the earlier save failing must not stop the final one
            log.error("preempt.inflight_failed", error=str(exc),
                      error_type=type(exc).__name__)
    waited = time.monotonic() - started
    reason: str | None = None
    try:
        save_final()
        saver.close()
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
    with watchdog.busy("preempt.final_snapshot"):  # peers wait here for the writer
        reasons = _agreed_failure(ctx, reason)
    now = time.monotonic()
    since_notice = stop.notice_age_s + (now - stop.agreed_at)
    fields = {"snapshot_step": step, "duration_s": round(since_notice, 3),
              "grace_period_s": stop.grace_period_s,
              "source": stop.local.source if stop.local else "peer"}
    if reasons:
        log.error("preempt.failed", reason=reasons[0], exit_code=EXIT_PREEMPTED_UNSAVED,
                  **fields)
        raise preempt.PreemptedExit(EXIT_PREEMPTED_UNSAVED)
    log.info("preempt.saved", save_s=round(now - started - waited, 3),
             inflight_wait_s=round(waited, 3),
             grace_left_s=round(stop.grace_period_s - since_notice, 3),
             within_grace=since_notice <= stop.grace_period_s, **fields)
    raise preempt.PreemptedExit(EXIT_PREEMPTED)


def _agreed_failure(ctx: DistContext, reason: str | None) -> list[str]:
    """The first failed rank's reason on every rank ([] when the final save succeeded
    everywhere): one all-reduce of the lowest failed rank, and its reason broadcast only
    when there is one (no rank receives all N ranks' answers)."""
    failed = reason is not None
    (lowest,) = ctx.all_reduce_max([ctx.world_size - ctx.rank if failed else 0])
    if not lowest:
        return []
    return [ctx.broadcast_object(reason, src=ctx.world_size - lowest)]
