"""The manager's side of the rescue (``snapshot.rescue``, docs/memory-tier.md#rescue):
a record of every step boundary, and on an uncaught error a commit of the last
boundary to this node's memory tier. The protocol between ranks, the agent and the
records is snapshot/memory/rescue.py's; on several nodes each record also goes to other
nodes (snapshot/memory/peer_records.py), so a survivor there can rescue a lost node's step.

On several nodes the record of a step leaves before the optimizer step (the
optimizer's step pre-hook), and that step waits for the other nodes' records of it:
a node lost after its last all-reduce of a step then costs that one step, not the
memory interval. That record is the boundary's own as long as nothing draws random
numbers between ``optimizer.step()`` and ``manager.step()``; each boundary checks it,
and a rank that finds otherwise sends its boundary records from then on.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from elastictrain.core.config import SnapshotConfig
from elastictrain.core.log import get_logger
from elastictrain.snapshot.durable.saver import Saver
from elastictrain.snapshot.durable.saver_interface import SaverSettings
from elastictrain.snapshot.memory import rescue
from elastictrain.snapshot.memory.peer_records import RecordStream
from elastictrain.snapshot.memory.rescue import (
    BoundaryRecord,
    read_record,
    record_step,
    same_states,
)
from elastictrain.snapshot.node_memory import NodeMemory
from elastictrain.snapshot.state.training_state import TrainingState
from elastictrain.worker import watchdog
from elastictrain.worker.dist import DistContext

log = get_logger("elastictrain.snapshot")

# How long a rescue waits for another node's record of its step that may still be on its
# way (sent a moment before that node died, not yet written here); past it, it skips.
PEER_RECORD_WAIT_S = 1.0
_PEER_RECORD_POLL_S = 0.005
# How long an optimizer step waits for the other nodes' records of its step without a
# watchdog: as long as a collective waits by default (dist.collective_timeout_s). With
# one, half the time it leaves, so that the rescue runs before it fires.
_PRE_STEP_WAIT_S = 600.0
_PRE_STEP_WAIT_MIN_S = 1.0


class Rescuer:
    """Records this rank's step boundaries and rescues the last one on an error.

    Args:
        enabled: ``snapshot.rescue`` is on for a replicated model.

    Attributes:
        resumed_from: the step this attempt resumed from (-1: fresh), in every record.
    """

    def __init__(self, *, enabled: bool, config: SnapshotConfig, ctx: DistContext,
                 node_memory: NodeMemory, train: TrainingState) -> None:
        self._enabled = enabled
        self._config, self._ctx, self._memory, self._train = config, ctx, node_memory, train
        self.resumed_from = -1
        self._boundary: BoundaryRecord | None = None
        self._stream: RecordStream | None = None
        self._pre_step_record: bytes | None = None  # the last one sent
        # The last step whose record sent before its optimizer step proved to be its
        # boundary's: this rank then trusts the other nodes' records of that step taken
        # the same way (its own loop draws nothing between the two).
        self._pre_step_matched = -1
        register = getattr(train.optimizer, "register_step_pre_hook", None)
        self._hook = register(self._before_optimizer_step) if enabled and register else None

    @property
    def active(self) -> bool:
        """Whether each step records its boundary (the memory tier is open)."""
        return self._enabled and self._memory.tier is not None

    def record_boundary(self, step: int) -> None:
        """This step's boundary record. A node whose memory directory refuses it (full)
        goes on without the rescue until a record succeeds again: a rescue finds the
        record of the step it would commit, or skips."""
        try:
            boundary = self._start()
            data = boundary.capture(step)
            if data is None:
                return
            self._send_boundary(step, data)
            boundary.keep(step, data)
        except OSError as exc:
            self._memory.health.failed("rescue boundary record", exc)
            return
        self._memory.health.ok("rescue boundary record")

    def _start(self) -> BoundaryRecord:
        """The boundary record (and the stream to other nodes), at first use."""
        if self._boundary is None:
            assert self._memory.tier is not None
            self._boundary = BoundaryRecord(self._memory.tier.boundary, self._ctx.rank,
                                            self._attempt(), self._train.held_tensors)
            rescue.arm(self._rescue)
            self._stream = self._start_stream()
        return self._boundary

    def _send_boundary(self, step: int, data: bytes) -> None:
        """The boundary record to other nodes, unless the one sent before the optimizer
        step holds the same states. One that differs means this loop draws random
        numbers in between: from here on the records go at the boundary."""
        stream, sent = self._stream, self._pre_step_record
        if stream is None:
            return
        if sent is None or record_step(sent) != step:  # none sent for this step
            stream.publish(data)
        elif same_states(sent, data):
            self._pre_step_matched = step
        else:
            stream.publish(data)
            stream.stop_pre_step()
            log.warning("snapshot.records_pre_step_off", step=step,
                        reason="random numbers were drawn between optimizer.step() and "
                        "manager.step(); the records go at the step boundary from here on")

    def _before_optimizer_step(self, *_: Any) -> None:
        """(the optimizer's step pre-hook) Send this rank's record of the step about to
        complete and wait for the other nodes' (peer_records.wait_pre_step)."""
        step = self._train.step + 1
        sent = self._pre_step_record
        if not self.active or (sent is not None and record_step(sent) == step):
            return  # a second optimizer step before the boundary: once per step
        try:
            boundary = self._start()
        except OSError as exc:
            self._memory.health.failed("rescue boundary record", exc)
            return
        stream = self._stream
        if stream is None or not stream.pre_step:
            return
        data = boundary.capture(step, pre_step=True)
        if data is None:
            return
        self._pre_step_record = data
        stream.publish(data, pre_step=True)
        left = watchdog.left_s()
        stream.wait_pre_step(step, _PRE_STEP_WAIT_S if left is None
                             else max(_PRE_STEP_WAIT_MIN_S, left / 2))

    def _start_stream(self) -> RecordStream | None:
        """This rank's records to other nodes, theirs to this node (several nodes and
        ``memory_replicas`` > 0: the manager found peers)."""
        peers = self._memory.peers
        if peers is None or self._memory.tier is None:
            return None
        return RecordStream(peers.record_links, self._ctx.rank, self._memory.tier.boundary,
                            lambda exc: self._memory.health.failed("rescue boundary record",
                                                                    exc))

    def disarm(self) -> None:
        """No rescue from here on (the run's end was agreed)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._boundary is not None:
            rescue.disarm()
            self._boundary.close()
            self._boundary = None

    def close(self) -> None:
        """Disarm, then end the record stream: a bounded wait for the other nodes'
        ends (peer_records.END_WAIT_S), which a node lost after the agreed end never
        sends."""
        self.disarm()
        if self._stream is not None:
            self._stream.close()  # it closes the connections
            self._stream = None
        elif self._memory.peers is not None:  # no record was taken: nothing to end
            self._memory.peers.record_links.close()

    def _attempt(self) -> tuple[int, int, int]:
        # The job's attempt, alike on every node (snapshot/state/attempt.py): torchrun's
        # restart count is each agent's own, and a joining node's is 0.
        assert self._memory.attempt is not None  # agreed wherever the tier is configured
        return self._ctx.world_size, self._memory.attempt, self.resumed_from

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
        if self._memory.saver is not None and self._memory.taken_step == step:
            # This process writes that step's memory snapshot itself, so no rescue is
            # needed; but its persist dies with the process unless it finishes first.
            self._memory.saver.wait_in_flight(step)
        rngs = [] if reason else self._records(record.directory, step)
        missing = [rank for rank, state in enumerate(rngs) if state is None]
        if missing:
            reason = (f"no record of step {step} on this node for rank(s) {missing} (on "
                      "another node, or killed while writing or sending it)")
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

    def _records(self, directory: Path, step: int) -> list[dict[str, Any] | None]:
        """Every rank's record of ``step`` on this node. One that another node sends
        here and that is not here yet is waited for, a moment (``PEER_RECORD_WAIT_S``):
        it may have been received and not yet written."""
        attempt = self._attempt()
        expected = self._peer_sources()
        # Another node's record taken before its optimizer step is its boundary's when
        # this rank's own proved so at this step (the same loop on every rank).
        trusted = self._pre_step_matched == step
        rngs = [read_record(directory, rank, step, attempt,
                            pre_step_ok=rank in expected and trusted)
                for rank in range(self._ctx.world_size)]
        deadline = time.monotonic() + PEER_RECORD_WAIT_S
        while any(rngs[r] is None for r in expected) and time.monotonic() < deadline:
            time.sleep(_PEER_RECORD_POLL_S)  # another process of this node writes them
            for rank in expected:
                if rngs[rank] is None:
                    rngs[rank] = read_record(directory, rank, step, attempt, pre_step_ok=trusted)
        return rngs

    def _peer_sources(self) -> set[int]:
        """The ranks of other nodes whose records reach this node."""
        peers = self._memory.peers
        if peers is None or self._config.memory_replicas == 0:
            return set()
        here = peers.nodes.ranks(peers.node)
        return {src for rank in here
                for src in peers.nodes.record_sources(rank, self._config.memory_replicas)}

    def _refusal(self, record: BoundaryRecord) -> str | None:
        """Why this rank's state is not exactly its last boundary's, or None."""
        if self._train.ranked.active:
            # The step records hold RNG states only: recording a loader's state at every
            # step costs more than the rescue saves (docs/elastic-resume.md#per-rank-state).
            return ("per-rank state (state=, rank_extras) is not in the step records; the "
                    "restart resumes from the newest snapshot")
        if record.step != self._train.step:
            return f"the manager is at step {self._train.step}, its record at {record.step}"
        if not record.unchanged():
            return (f"parameters, buffers or optimizer state changed after step {record.step} "
                    "(the failure came after optimizer.step() or a buffer update)")
        if self._memory.taken_step == record.step:  # its directory: one writer per step
            return f"a memory snapshot of step {record.step} was already taken"
        return None
