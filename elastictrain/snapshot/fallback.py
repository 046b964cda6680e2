"""A restore that made no sense: set its snapshot aside and restart from the one before.

Called on every rank together, once the restore watch (state/sense_check.py) agreed on
a verdict, with the rescue disarmed (the error raised here must not rescue a step of
the suspect state to node memory). The saves in flight finish first (a snapshot taken
after the restore descends from the suspect state: it is set aside with it); every node
drops its memory copies of that step and later; rank 0 moves the suspect snapshot and
its descendants out of ``snapshots/`` (durable/suspects.py) and counts the fallbacks in
a row. Every rank then raises the same error: ``SnapshotSuspect`` (exit 1, the launcher
restarts the group, whose restore finds the snapshot before) or, past
``snapshot.check_max_fallbacks`` or with nothing older to fall back to, ``SuspectLimit``
(exit 78).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NoReturn

from elastictrain.core.errors import SnapshotSuspect, SuspectLimit
from elastictrain.core.log import get_logger
from elastictrain.runlog.events import launch_id
from elastictrain.snapshot.durable.suspects import SuspectRecord, in_a_row, set_aside
from elastictrain.snapshot.format.commitmark import is_committed
from elastictrain.snapshot.format.reader import list_snapshot_dirs
from elastictrain.snapshot.node_memory import NodeMemory
from elastictrain.snapshot.state.sense_check import Senseless
from elastictrain.storage.api import Store
from elastictrain.worker.dist import DistContext

log = get_logger("elastictrain.snapshot")


def fall_back(seen: Senseless, *, store: Store, ctx: DistContext, node_memory: NodeMemory,
              finish_saves: Callable[[], None], run_id: str,
              max_fallbacks: int) -> NoReturn:
    """Set the suspect snapshot aside and raise (module docstring)."""
    suspect = seen.snapshot
    with contextlib.suppress(Exception):  # a failing persist changes nothing here
        finish_saves()
    node_memory.drop_newer(suspect.step - 1)  # this node's copies of the step and later
    outcome: tuple[list[int], int | None, str | None] = ([], None, None)
    if ctx.is_writer:
        try:
            outcome = _set_aside_all(store, seen, run_id)
        except Exception as error:  # every rank must learn of it, or the others hang
            outcome = ([], None, f"{type(error).__name__}: {error}"[:300])
    in_row, head, problem = ctx.broadcast_object(outcome)  # also: rank 0 is done moving
    stop = problem is not None or head is None or len(in_row) > max_fallbacks
    if ctx.is_writer:
        log.error("snapshot.suspect", snapshot_step=suspect.step, tier=suspect.tier,
                  reason=seen.reason, at_step=seen.at_step, loss=seen.loss,
                  recorded_loss=suspect.recorded_loss, in_a_row=len(in_row),
                  limit=max_fallbacks, restore_next=None if stop else head,
                  action="stopped" if stop else "set aside; restarting from the snapshot before",
                  error=problem)
    steps = ", ".join(str(s) for s in in_row) or str(suspect.step)
    what = (f"the restore of step {suspect.step} ({suspect.tier}) made no sense: {seen.reason} "
            f"(at step {seen.at_step})")
    if problem is not None:
        raise SuspectLimit(f"{what}; setting it aside failed ({problem}); fix: move "
                           f"snapshots/step_{suspect.step:012d} out of the storage by hand, "
                           "then run the same command")
    if head is None:
        raise SuspectLimit(f"{what}; no earlier snapshot is committed to fall back to; fix: "
                           "check the training script and the nodes, then start over (the "
                           "suspect snapshots are kept under suspect/ in the storage)")
    if len(in_row) > max_fallbacks:
        raise SuspectLimit(f"{what}; {len(in_row)} snapshots in a row were set aside (steps "
                           f"{steps}; snapshot.check_max_fallbacks={max_fallbacks}): the "
                           "fault is not in one snapshot; fix: check the script, its data "
                           "and the nodes (a node computing wrong), then run the same command")
    raise SnapshotSuspect(f"{what}; set aside under suspect/ in the storage; the restart "
                          f"restores step {head}")


def _set_aside_all(store: Store, seen: Senseless,
                   run_id: str) -> tuple[list[int], int | None, str | None]:
    """Rank 0: the suspect step and every durable snapshot committed after it (taken
    since the restore: its descendants) out of ``snapshots/``; then the fallbacks in a
    row and the step the restart will restore."""
    suspect = seen.snapshot
    launch = launch_id()
    set_aside(store, SuspectRecord(
        step=suspect.step, tier=suspect.tier, reason=seen.reason, at_step=seen.at_step,
        loss=seen.loss, recorded_loss=suspect.recorded_loss, run_id=run_id,
        launch_id=launch))
    for later in list_snapshot_dirs(store):
        if later > suspect.step and is_committed(store, later):
            set_aside(store, SuspectRecord(
                step=later, tier="durable", reason=f"taken after the restore of the suspect "
                f"step {suspect.step}", at_step=seen.at_step, loss=None,
                recorded_loss=None, run_id=run_id, launch_id=launch,
                descends_from=suspect.step))
    in_row, head = in_a_row(store)
    return [r.step for r in in_row], head, None
