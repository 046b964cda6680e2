"""The manager's side of the rescue (``snapshot.rescue``, docs/memory-tier.md#rescue):
a record of every step boundary, and on an uncaught error a commit of the last
boundary to this node's memory tier. The protocol between ranks, the agent and the
records is snapshot/rescue.py's.
"""

from __future__ import annotations

import time

from elastictrain.config import SnapshotConfig
from elastictrain.dist import DistContext
from elastictrain.log import get_logger
from elastictrain.snapshot import rescue
from elastictrain.snapshot.node_memory import NodeMemory
from elastictrain.snapshot.rescue import BoundaryRecord, read_record
from elastictrain.snapshot.saver import Saver
from elastictrain.snapshot.saver_interface import SaverSettings
from elastictrain.snapshot.training_state import TrainingState

log = get_logger("elastictrain.snapshot")


class Rescuer:
    """Records this rank's step boundaries and rescues the last one on an error.

    Args:
        enabled: ``snapshot.rescue`` is on for a replicated model.
        restart_count: this attempt's (torchrun's restart count), in every record.

    Attributes:
        resumed_from: the step this attempt resumed from (-1: fresh), in every record.
    """

    def __init__(self, enabled: bool, config: SnapshotConfig, ctx: DistContext,
                 node_memory: NodeMemory, train: TrainingState, restart_count: int) -> None:
        self._enabled = enabled
        self._config, self._ctx, self._memory, self._train = config, ctx, node_memory, train
        self._restart_count = restart_count
        self.resumed_from = -1
        self._boundary: BoundaryRecord | None = None

    @property
    def active(self) -> bool:
        """Whether each step records its boundary (the memory tier is open)."""
        return self._enabled and self._memory.tier is not None

    def record_boundary(self, step: int) -> None:
        """This step's boundary record. A node whose memory directory refuses it (full)
        goes on without the rescue until a record succeeds again: a rescue finds the
        record of the step it would commit, or skips."""
        assert self._memory.tier is not None
        try:
            if self._boundary is None:
                self._boundary = BoundaryRecord(self._memory.tier.boundary, self._ctx.rank,
                                                self._attempt(), self._train.held_tensors)
                rescue.arm(self._rescue)
            self._boundary.record(step)
        except OSError as exc:
            self._memory.health.failed("rescue boundary record", exc)
            return
        self._memory.health.ok("rescue boundary record")

    def close(self) -> None:
        if self._boundary is not None:
            rescue.disarm()
            self._boundary.close()
            self._boundary = None

    def _attempt(self) -> tuple[int, int, int]:
        return self._ctx.world_size, self._restart_count, self.resumed_from

    def _rescue(self, error: BaseException) -> None:
        """On an uncaught error (runtime's excepthook): commit the last boundary to this
        node's memory tier if the state is still exactly that step's and every rank's
        RNG record of it is on this node; else log why not."""
        record = self._boundary
        if record is None or record.step is None:
            return
        # Marked first, before the lock and any wait: the agent waits for a rescue
        # from the moment one may begin (it stops the others once this returns).
        with rescue.rescuing(rescue.marks_dir(record.directory)):
            self._rescue_marked(record, error)

    def _rescue_marked(self, record: BoundaryRecord, error: BaseException) -> None:
        assert record.step is not None
        started = time.perf_counter()
        step = record.step
        fields = {"snapshot_step": step, "tier": "memory", "error": type(error).__name__}
        reason = self._refusal(record)
        rngs = [] if reason else [read_record(record.directory, rank, step, self._attempt())
                                  for rank in range(self._ctx.world_size)]
        missing = [rank for rank, state in enumerate(rngs) if state is None]
        if missing:
            reason = (f"no record of step {step} on this node for rank(s) {missing} (on "
                      "another node, or killed while writing it)")
        if reason is None and (not rescue.take_lock(record.directory, self._attempt(), step)
                               or rescue.was_rescued(record.directory, step)):
            log.info("snapshot.rescue_skipped", reason="another rank of this node rescues "
                     "this step", **fields)
            return
        if reason is not None:
            log.warning("snapshot.rescue_skipped", reason=reason, **fields)
            return
        if self._memory.saver is not None:  # our own periodic memory save commits first
            self._memory.saver.wait_in_flight(step)
        assert self._memory.store is not None
        saver = Saver(self._memory.store, SaverSettings.for_rescue(self._config), tier="memory")
        try:
            saver.save(self._train.payload(rngs), self._train.meta(),  # type: ignore[arg-type]
                       started)
        finally:
            saver.close()
        rescue.mark_rescued(record.directory, step)
        log.info("snapshot.rescued", duration_s=round(time.perf_counter() - started, 4),
                 **fields)

    def _refusal(self, record: BoundaryRecord) -> str | None:
        """Why this rank's state is not exactly its last boundary's, or None."""
        if record.step != self._train.step:
            return f"the manager is at step {self._train.step}, its record at {record.step}"
        if not record.unchanged():
            return (f"parameters, buffers or optimizer state changed after step {record.step} "
                    "(the failure came after optimizer.step() or a buffer update)")
        if self._memory.taken_step == record.step:  # its directory: one writer per step
            return f"a memory snapshot of step {record.step} was already taken"
        return None
