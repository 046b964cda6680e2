"""The end of a run, agreed by every rank and marked for each node's agent.

``SnapshotManager.close()`` is where every rank of a finished run meets last: the
loop is over and the snapshots are written. There the ranks agree that they all got
that far (a barrier, bounded in time), and each marks it in a private directory its
agent named (``ELASTICTRAIN_END_DIR``, set by ``elastictrain run``). A worker that
fails after that mark (in teardown, or while a peer on another node has already gone)
failed after the run's end: its agent waits for its other workers and ends the job with
exit 0 instead of restarting a finished run (``agent.py``). Under plain torchrun the
variable is unset and only the agreement runs.

No agreement (a peer failed, or never came) is a failure of the run's end:
``SnapshotManager.close()`` raises, and the launcher (torchrun's agent or ours) restarts
the workers. A survivor that exited 0 instead would leave its agent waiting for the
lost node in torchrun's exit barrier while that node's replacement waits in a
rendezvous no one else joins.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from elastictrain.core.env import END_DIR_VAR
from elastictrain.core.log import get_logger
from elastictrain.handoff import end_marks
from elastictrain.worker import watchdog
from elastictrain.worker.dist import DistContext

# How long ranks that reached close() wait for the others: a rank still training or
# evaluating longer than this before its own close() means no agreed end, no mark.
AGREEMENT_TIMEOUT_S = 300.0

log = get_logger("elastictrain.runend")


@dataclass(frozen=True)
class End:
    """The end agreement: ``agreed`` (every rank reached it), and the largest and
    smallest ``digest`` the ranks brought (equal when they hold one state)."""

    agreed: bool
    highest: int = 0
    lowest: int = 0


def all_reached(ctx: DistContext, values: list[int],
                timeout_s: float = AGREEMENT_TIMEOUT_S) -> list[int] | None:
    """The element-wise max of ``values`` over the ranks once every rank brought its
    own (an all-reduce bounded by ``timeout_s``), or None where a peer failed or did not
    come in time (``run.end_not_agreed`` logged: the caller raises)."""
    if not ctx.initialized:
        return list(values)
    try:
        # A peer still finishing its last save (a slow upload that moves) is no hang.
        with watchdog.busy("the end agreement"):
            return ctx.all_reduce_max(values, timeout_s)
    except Exception as exc:  # a peer gone or late: no agreed end
        log.warning("run.end_not_agreed", error=f"{type(exc).__name__}: {exc}"[:300])
        return None


def agree_and_mark(ctx: DistContext, digest: int = 0,
                   timeout_s: float = AGREEMENT_TIMEOUT_S) -> End:
    """Whether every rank reached the end; if so, this process is marked as ended for
    its agent. A peer that failed or never came makes it not agreed (logged here; the
    caller raises). ``digest``: this rank's replicated state, reduced in the same
    all-reduce (the largest and smallest come back, for the caller to compare)."""
    end = End(True, digest, digest)
    if ctx.initialized:
        reduced = all_reached(ctx, [digest, -digest], timeout_s)
        if reduced is None:
            return End(False)
        log.info("run.end_agreed")
        end = End(True, reduced[0], -reduced[1])
    directory = os.environ.get(END_DIR_VAR)
    if directory:
        end_marks.mark(Path(directory), os.getpid())
    return end
