"""SnapshotManager: periodic snapshots and verified restore for a DDP training loop.

Call order (every rank runs the same calls)::

    manager = SnapshotManager(url, model=ddp_model, optimizer=opt, sampler=sampler, ...)
    resume = manager.restore()      # (rank 0) list → (all) read + verify + load → agree
    for batch in loader:
        ...optimizer.step()
        manager.step()              # advance; when due: (all) gather RNG → (rank 0)
                                    # stage, then persist → commit → prune in the background
    manager.close()                 # wait for the save in flight

With ``memory_every`` set, the steps between durable saves snapshot to the node-memory
tier instead: (all) gather RNG → (local rank 0 of every node) stage, then persist to
the node's memory directory in the background; ``restore()`` prefers that copy when
it is newer than the durable one and every node holds it, or some node does and sends
it to the others (memory/memory_load.py, memory/peer_restore.py).

Snapshots are taken at step boundaries only, so every rank decides the same:
step triggers are deterministic; time triggers, preemption notices
(``elastictrain.worker.preempt``) and a background persist that gave up are agreed
with one small all-reduce per step where one is needed (preemption on, or a
time trigger); without it a failed persist is agreed at the next save, which
gathers it with the RNG states. So ``SnapshotWriteFailed`` is raised on every
rank at the same step. On an agreed notice ``step()`` takes a final snapshot of
that step and exits 75, or 76 when it could not be committed.

Built without ``ctx``/``config``, the manager takes the process group and the
settings from ``elastictrain.init()`` (or finds an initialised group itself), once,
in snapshot/manager_setup.py.

The manager is a facade; each part has its own module: when a snapshot is taken
(save_schedule.py), the state it holds and how a restore applies it
(training_state.py, resume.py), the savers (saver_interface.py, saver.py,
sharded/save.py), copy behind (copy_fence.py), the memory tier (node_memory.py), the
rescue (rescuer.py), and the final save on a preemption notice (preempt_exit.py).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from torch import nn

from elastictrain.core.config import SnapshotConfig, StorageConfig
from elastictrain.core.errors import RunEndNotAgreed, SnapshotWriteFailed
from elastictrain.core.log import bind_step, get_logger
from elastictrain.runlog.run_marker import record_run_id
from elastictrain.snapshot.copy_fence import CopyFence
from elastictrain.snapshot.durable.persister import SaveHandle
from elastictrain.snapshot.durable.resume import MemoryOutcome, ResumeInfo, apply_and_report
from elastictrain.snapshot.durable.saver import Saver
from elastictrain.snapshot.durable.saver_interface import LoadRequest, SaverSettings, SnapshotSaver
from elastictrain.snapshot.fallback import fall_back
from elastictrain.snapshot.format.digest import param_digest
from elastictrain.snapshot.manager_setup import ManagerSetup
from elastictrain.snapshot.node_memory import NodeMemory
from elastictrain.snapshot.preempt_exit import pending_stop, save_and_exit
from elastictrain.snapshot.rescuer import Rescuer
from elastictrain.snapshot.schedule.progress import ProgressFile, ProgressReport
from elastictrain.snapshot.schedule.restart_save import RestartRequest, save_before_restart
from elastictrain.snapshot.schedule.save_schedule import SaveSchedule
from elastictrain.snapshot.sharded.detect import has_dtensor_params
from elastictrain.snapshot.state import replica_check
from elastictrain.snapshot.state.rank_state import RankState
from elastictrain.snapshot.state.rng import capture_rng
from elastictrain.snapshot.state.sense_check import RestoreWatch, Senseless, loss_value
from elastictrain.snapshot.state.training_state import TrainingState, unwrap
from elastictrain.storage import Store
from elastictrain.worker import preempt, runend, session, watchdog
from elastictrain.worker.data import ElasticSampler
from elastictrain.worker.dist import DistContext

__all__ = ["ResumeInfo", "SnapshotManager", "unwrap"]

log = get_logger("elastictrain.snapshot")


class SnapshotManager:
    """Saves and restores everything a training loop needs to resume exactly.

    Args:
        storage: a URL (local path, ``file://``, ``memory://``, ``s3://…``), a
            StorageConfig (URL, options, retries, multipart settings) or a Store.
        model: the (DDP-wrapped or plain) model; saved unwrapped.
        optimizer, scheduler, scaler: optional; anything with state_dict().
        sampler: the ElasticSampler whose global position is saved.
            A URL takes the other storage settings from ``Settings``.
        state: more objects by name, anything with ``state_dict()`` /
            ``load_state_dict()`` (a torchdata ``StatefulDataLoader``): each rank's own
            state is saved with its RNG states and restored to the same rank
            (docs/elastic-resume.md#per-rank-state).
        config: snapshot policy; default: ``Settings.snapshot`` (``elastictrain.init``'s,
            else loaded from the TOML file and ``ELASTICTRAIN_*``). Keyword overrides
            (``every_steps=…``) win over it.
        ctx: the process group; default: ``elastictrain.init``'s, else the initialised
            ``torch.distributed`` group, else a single process.
        run_id: recorded in manifests; defaults to the settings', then torchrun's run id.
        storage_options: passed to fsspec (credentials: never logged).
        progress_dir: local directory for a tiny per-rank step counter, used to
            report how many steps a restart lost (the ``resume`` event's
            ``lost_steps``). None: this worker's events directory under
            ``elastictrain.init``, else none; False disables it.
        clock: monotonic seconds for ``every_seconds`` (tests inject a fake one).
        sharded: save model and optimizer from every rank through DCP (FSDP2/DTensor
            state, docs/sharded.md); None: when the model's parameters are DTensors.

    Raises:
        ConfigError: a setting is invalid, ``WORLD_SIZE`` > 1 and no process
            group is initialised (call ``elastictrain.init()`` first).
    """

    def __init__(
        self,
        storage: str | StorageConfig | Store,
        *,
        model: nn.Module,
        optimizer: Any | None = None,
        scheduler: Any | None = None,
        scaler: Any | None = None,
        sampler: ElasticSampler | None = None,
        state: dict[str, Any] | None = None,
        config: SnapshotConfig | None = None,
        ctx: DistContext | None = None,
        run_id: str | None = None,
        storage_options: dict[str, Any] | None = None,
        progress_dir: str | Path | bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        sharded: bool | None = None,
        **overrides: Any,
    ) -> None:
        setup = ManagerSetup.find(storage, config=config, ctx=ctx, run_id=run_id,
                                  storage_options=storage_options, overrides=overrides)
        self.config, self.ctx, self.store = setup.config, setup.ctx, setup.store
        self.run_id = setup.run_id
        if setup.fixed_order_reduction:  # before the first backward pass
            _reduce_in_fixed_order(model)
        self.sharded = has_dtensor_params(unwrap(model)) if sharded is None else sharded
        durable = SaverSettings.for_durable(self.config)
        self._saver: SnapshotSaver
        if self.sharded:  # imported here: DCP costs a DDP worker's start-up a second
            from elastictrain.snapshot.sharded.save import ShardedSaver
            self._saver = ShardedSaver(self.store, durable, self.ctx, unwrap(model), optimizer)
        else:
            self._saver = Saver(self.store, durable)
        self._train = TrainingState(model, optimizer, scheduler, scaler, sampler, ctx=self.ctx,
                                    run_id=self.run_id, checksum=self.config.checksum,
                                    saver_holds_model=self._saver.saves_model_and_optimizer,
                                    ranked=RankState(state))
        self._node_memory = NodeMemory(self.config, self.run_id, self.store, self.ctx,
                                       sharded=self.sharded, model=unwrap(model),
                                       optimizer=optimizer)
        self.memory_store = self._node_memory.store
        self._train.attempt = self._node_memory.attempt  # in every manifest it writes
        self._memory = self._node_memory.saver
        # The storage is accepted (the memory tier's checks passed): name its run, once
        # (every rank read the same marker; one write is enough).
        if self.ctx.rank == 0:
            record_run_id(self.store, self.run_id)
        self._restart = RestartRequest.from_env()
        self._schedule = SaveSchedule(self.config, self.ctx, setup.events_dir, clock,
                                      self._restart)
        # Before the copy fence: its optimizer-step hook then runs first, and a record
        # other nodes wait for leaves before this rank waits for its copies.
        self._rescuer = Rescuer(enabled=self.config.rescue and not self.sharded, config=self.config,
                                ctx=self.ctx, node_memory=self._node_memory, train=self._train)
        self._fence = CopyFence(self.config, self._train, sharded=self.sharded,
                                savers=[s for s in (self._saver, self._memory) if s is not None],
                                schedule=self._schedule)
        self._last_handle: SaveHandle | None = None
        self._report = ProgressReport(self.config.progress_every_s, clock)
        self._watch = RestoreWatch(self.ctx, self.config.check_steps,
                                   self.config.check_loss_factor)
        self._loss: Any = None  # the loss step() was last given (read only when saved)
        if progress_dir is None or progress_dir is True:
            progress_dir = setup.events_dir  # beside this worker's events (local, per rank)
        self._progress = ProgressFile(progress_dir, self.ctx.rank) if progress_dir else None
        self._preempt = setup.preemption
        self._stepped = False  # staging is prepared again at the first step (see step())
        # The step a durable snapshot holds, saved or restored by this process (None:
        # none yet): close() saves the last step when it is another.
        self._durable_step: int | None = None
        self._saved_at: int | None = None  # the step this process last saved durably

    # -- the training loop's objects and position -----------------------------------------
    @property
    def model(self) -> nn.Module:
        return self._train.model

    @property
    def optimizer(self) -> Any | None:
        return self._train.optimizer

    @property
    def scheduler(self) -> Any | None:
        return self._train.scheduler

    @property
    def scaler(self) -> Any | None:
        return self._train.scaler

    @property
    def sampler(self) -> ElasticSampler | None:
        return self._train.sampler

    @property
    def step_count(self) -> int:
        """The optimizer steps completed (restored by ``restore()``)."""
        return self._train.step

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._train.step = value

    @property
    def extras(self) -> dict[str, Any]:
        """The user's own values, saved and restored with every snapshot."""
        return self._train.extras

    @extras.setter
    def extras(self, value: dict[str, Any]) -> None:
        self._train.extras = value

    @property
    def rank_extras(self) -> dict[str, Any]:
        """This rank's own values, saved and restored per rank (``extras``: rank 0's,
        the same for all); a resume at another world size refuses them."""
        return self._train.ranked.extras

    @rank_extras.setter
    def rank_extras(self, value: dict[str, Any]) -> None:
        self._train.ranked.extras = value

    @property
    def epoch(self) -> int:
        """The epoch in progress. The sampler owns it when there is one (it orders the
        epoch's samples); the manager only without a sampler."""
        return self._train.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._train.epoch = value

    # -- restore ----------------------------------------------------------------------
    @watchdog.busy("snapshot.restore")
    def restore(self) -> ResumeInfo:
        """Load the newest verified snapshot on every rank (or start fresh).

        Raises:
            SnapshotSuspect: the restored state is not finite (set aside; the restart
                restores the snapshot before); SuspectLimit: too many in a row (78).
        """
        started = time.perf_counter()
        self._fence.wait()  # loading overwrites the parameters a copy behind may still read
        if self.ctx.is_writer:
            self._saver.warm_up()  # a persister process starts while we load
        if self._memory is not None:
            self._memory.warm_up()
        loaded = self._saver.load_newest(LoadRequest(
            self.ctx, self.config.restore_mode, self._train.in_place(),
            self._node_memory.memory_first(), self._node_memory.sharded_memory))
        step = loaded.step if loaded else None
        self._rescuer.resumed_from = -1 if step is None else step
        self._node_memory.drop_newer(step)  # every rank has loaded: nobody reads them
        agreed = self._node_memory.agree_outcome(
            step if loaded and loaded.tier == "memory" else None)
        outcome = MemoryOutcome(*agreed) if agreed is not None else MemoryOutcome()
        if agreed is not None:
            memory_kept, rescued = agreed
            self._schedule.failures_resolved(memory_kept=memory_kept, rescued=rescued)
        previous_high = self._progress.read() if self._progress else None
        # The job's highest step: a replaced node's ranks know none of their own.
        (highest,) = self.ctx.all_reduce_max([-1 if previous_high is None else previous_high])
        previous_high = None if highest < 0 else highest
        info = apply_and_report(loaded, self._train, self.ctx, previous_high, outcome,
                                self.config.restore_mode, started)
        if loaded is not None:  # are the restored bytes sensible, too? (every rank)
            seen = self._watch.restored(loaded.step, loaded.tier, loaded.payload.get("loss"),
                                        self._train.held_tensors())
            if seen is not None:
                self._fall_back(seen)
        if loaded is not None and loaded.tier != "memory":
            self._durable_step = self.step_count
        if loaded is not None:
            # The restored step is the last save: intervals count from it, not from
            # step 0 (with every_steps="auto" the steps since 0 made a wrong step time).
            self._schedule.durable_taken(self.step_count)
        # Staging (pinned for CUDA state: slow to allocate) for what exists now, in the
        # background, so the first save finds it ready (docs/performance.md#the-first-save).
        self._prepare_staging(durable=True, memory=True)
        return info

    def _prepare_staging(self, *, durable: bool, memory: bool) -> None:
        for saver, wanted in ((self._saver if self.ctx.is_writer else None, durable),
                              (self._memory, memory)):
            if saver is not None and wanted:
                # RNG states only: asking a loader for its state would start its workers
                # (torchdata); the per-rank states are small and staged at the first save.
                saver.prepare_ahead(
                    lambda: self._train.payload([capture_rng()] * self.ctx.world_size))

    # -- the training loop's side ----------------------------------------------------
    def step(self, loss: Any = None) -> SaveHandle | None:
        """Record one completed optimizer step; save if one is due.

        Args:
            loss: this step's loss (float or 0-d tensor), read only when needed: for
                the periodic ``train.progress`` event, to record with a snapshot taken
                at this step, and in the first ``snapshot.check_steps`` steps after a
                restore, which are checked for sense (docs/restore.md).

        Raises:
            SnapshotWriteFailed: a background persist gave up; raised on every rank at
                the same step, after the step is recorded, so a loop that catches it
                goes on in lockstep.
            SnapshotSuspect: the restore made no sense (set aside; the restart restores
                the snapshot before); SuspectLimit: too many in a row (exit 78).
        """
        self.step_count += 1
        if self.sampler is not None:
            self.sampler.advance()
        if self._rescuer.active:  # first: a failure anywhere after this finds the boundary
            self._rescuer.record_boundary(self.step_count)
        if self._restart is not None:
            self._restart.stepped()
        bind_step(self.step_count)
        if self._progress is not None:
            self._progress.write(self.step_count)
        watchdog.beat(self.step_count)
        self._train.buckets.observe()  # before a save of this step records it
        self._report.step(loss)
        self._loss = loss
        if self._watch.active:  # the first steps after a restore: before any save of them
            seen = self._watch.observe(self.step_count, loss, self._train.held_tensors)
            if seen is not None:
                self._fall_back(seen)
        decision = self._schedule.decide(self.step_count, self._failed_step, self._preempt)
        if not self._stepped:  # once more: an optimizer's state appears at its first step
            self._stepped = True
            self._prepare_staging(durable=not decision.durable, memory=not decision.memory)
        if decision.stop is not None:
            self._stop_preempted(decision.stop)
        if decision.failed_step:
            self._raise_failed(decision.failed_step)
        if decision.restart:
            self._save_before_restart()
            return None
        if decision.durable:
            try:
                return self.save()
            except SnapshotWriteFailed:
                # Raised on every rank alike (agreed in save()); a notice that arrived
                # while save() waited for the failing persist still gets its final save.
                stop = pending_stop(self._preempt, self.ctx)
                if stop is None:
                    raise
                self._stop_preempted(stop)
        if decision.memory:
            self._save_memory()
        return None

    def _fall_back(self, seen: Senseless) -> NoReturn:
        # The error that ends this attempt must not rescue a step of the suspect state.
        self._rescuer.disarm()
        fall_back(seen, store=self.store, ctx=self.ctx, node_memory=self._node_memory,
                  finish_saves=self.wait, run_id=self.run_id,
                  max_fallbacks=self.config.check_max_fallbacks)

    def _persists_here(self) -> bool:
        return self.ctx.is_writer or self.sharded  # sharded: every rank persists

    def _failed_step(self) -> int:
        """This rank's contribution to agreeing on a failed persist (the writer's)."""
        return self._saver.failed_step() if self.ctx.is_writer else 0

    def _raise_failed(self, step: int) -> NoReturn:
        error = self._saver.take_failure() if self.ctx.is_writer else None
        raise error or SnapshotWriteFailed(
            f"the snapshot of step {step} failed on the writer (rank 0), see its "
            "snapshot.failed events; fix: make the storage writable and reachable, or "
            "raise snapshot.max_consecutive_failures / retry_backoff_s")

    def save(self) -> SaveHandle:
        """Snapshot the current step now (all ranks must call it at the same step).

        Raises:
            SnapshotWriteFailed: the previous save gave up (on every rank).
        """
        return self._save(copy_behind=True)

    def _save(self, *, copy_behind: bool, at_close: bool = False) -> SaveHandle:
        started = time.perf_counter()
        if self._persists_here():
            self._saver.wait_in_flight(self.step_count)  # its outcome is agreed below
        with watchdog.busy("snapshot.save"):
            # Only the writer saves the RNG states: gathered to it alone, so a rank
            # receives nothing (an all-gather would send every rank all N: N² in all);
            # the writer's failed persist, if any, is agreed in the same collective.
            rng, (failed_step,) = self.ctx.gather_object(self._train.rank_entry(),
                                                         agree=[self._failed_step()])
            self._schedule.durable_taken(self.step_count)
            self._durable_step = self.step_count
            # save() again at a step this process saved: the user changed state since
            # (``epoch += 1`` after the periodic save of an epoch's last step).
            replaces = self._saved_at == self.step_count
            self._saved_at = self.step_count
            if failed_step:
                self._raise_failed(failed_step)
            if not self._persists_here():
                return SaveHandle.completed(self.step_count)
            self._train.loss = _finite(self._loss)
            self._last_handle = self._saver.save(
                self._train.payload(rng or [], at_close=at_close),
                dataclasses.replace(self._train.meta(), replaces=replaces), started,
                self._fence.deferred() if copy_behind else frozenset())
            # What the loop waited for: back-pressure + staging (+ the fence's wait).
            self._schedule.durable_saved(time.perf_counter() - started,
                                         settled_at_fence=self._fence.active)
            return self._last_handle

    def _save_memory(self) -> None:
        """Snapshot this step to every node's memory (all ranks, same step): one RNG
        gather, then each node's local rank 0 stages and persists in the background."""
        started = time.perf_counter()
        self._schedule.memory_taken(self.step_count)
        if self._memory is not None:
            self._memory.wait_in_flight(self.step_count)
        with watchdog.busy("snapshot.save"):
            # Every rank gets every RNG state here: each node's copy holds all of them,
            # since after a re-rendezvous a node may host any rank (O(N) per rank, on
            # memory saves only; the durable save gathers to the writer alone).
            rng = self.ctx.all_gather_object(self._train.rank_entry())
            # Taken only once the gather succeeded: one that failed (a peer died) wrote
            # nothing, so the rescue may still commit this step.
            self._node_memory.taken_step = self.step_count
            if self._memory is None:
                return
            self._train.loss = _finite(self._loss)
            self._node_memory.save(self._train.payload(rng), self._train.meta(), started,
                                   defer=self._fence.deferred())
        self._schedule.memory_saved(time.perf_counter() - started)

    def _save_before_restart(self) -> None:
        """The agent restarts the group next (a node joins): snapshot this step first,
        to memory where every node has it, and wait to be stopped (restart_save.py)."""
        assert self._restart is not None  # only its request decides a restart save
        memory = self._memory_committed if self.config.memory_every is not None else None
        save_before_restart(self.ctx, self._restart, self.step_count, memory,
                            self._durable_committed)

    def _memory_committed(self) -> bool:
        """A memory snapshot of this step (every rank), waited for: whether this node's
        copy committed."""
        self._save_memory()
        if self._memory is None:  # a writer whose node refused the tier holds no copy
            return not (self.sharded or self.ctx.local_rank == 0)
        try:
            self._memory.wait()
        except Exception:  # logged by the persister; the caller falls back to durable
            return False
        return True

    def _durable_committed(self) -> bool:
        """A durable snapshot of this step (every rank), waited for: whether it committed
        where this rank persists."""
        try:
            self._save(copy_behind=False)
            if self._persists_here():
                self._saver.wait()
        except Exception:  # an agreed earlier failure, or this one: logged where it failed
            return False
        return True

    def _stop_preempted(self, stop: preempt.StopRequest) -> NoReturn:
        save_and_exit(stop, self.ctx, self._saver, persists_here=self._persists_here(),
                      save_final=lambda: self._save(copy_behind=False), step=self.step_count)

    def wait(self) -> None:
        """Block until the last save is durable (re-raises its failure, on the writer)
        and the memory snapshot in flight, if any, is committed (never raises).

        A persist that keeps writing bytes is not a hang to the watchdog; one that
        writes nothing for ``watchdog.timeout_s`` is.
        """
        self._saver.wait()
        if self._memory is not None:
            self._memory.wait_in_flight(self.step_count)

    def _save_last_step(self) -> None:
        """A durable snapshot of the step the run ends at, unless one exists or
        ``snapshot.save_on_close`` is off. Its collectives run only once every rank has
        reached close() (a bounded all-reduce that also agrees whether to save): a peer
        lost or late there is no agreed end, as in the agreement below. Before the
        ready mark in close(), so a restart for a node joining now resumes from it too."""
        wanted = int(self.config.save_on_close and self.step_count > 0
                     and self.step_count != self._durable_step)
        # Never while an error propagates on any rank (close() in a ``finally``): its
        # parameters may be half-way through a step that step_count does not count.
        vetoed = int(sys.exc_info()[1] is not None)
        agreed = runend.all_reached(self.ctx, [wanted, vetoed])
        if agreed is None:
            raise _end_not_agreed()
        if agreed[0] and not agreed[1]:
            held = self._durable_step
            try:
                self._last_handle = self._save(copy_behind=False, at_close=True)
                if self._persists_here():
                    self._saver.wait()  # its outcome here, not as close()'s error
            except SnapshotWriteFailed as error:  # an earlier save, or this one, gave up
                self._durable_step = held  # run.finished names what storage holds
                log.warning("snapshot.last_step_unsaved", snapshot_step=self.step_count,
                            error=str(error)[:300], action="the run ends without it")

    def close(self, **finished: Any) -> None:
        """Wait for the save in flight and release the persister (same watchdog rule);
        the writer logs the final parameters' digest (``params.digest``: equal digests,
        identical weights; replicated state only, a sharded model has no whole copy).

        The run finished: each node's memory snapshots are removed (only here: after a
        failure the restart needs them); the ranks agree that every one of them got here,
        so that a failure in teardown does not restart a finished run
        (``elastictrain.worker.runend``); and rank 0 logs ``run.finished`` (final step, epoch,
        digest and ``finished``'s fields), the clean end that goodput, status and the
        automatic interval read; not when called while an error propagates.

        Args:
            finished: more fields for the ``run.finished`` event (e.g. ``final_loss``).

        Raises:
            RunEndNotAgreed: a peer failed, or did not reach ``close()`` in time; the
                memory snapshots stay, and the rescue commits the last step, for the
                restart that finishes the run.
        """
        self._fence.remove()
        self._save_last_step()
        self._saver.close()
        self._node_memory.finish_saves()
        if self._restart is not None:  # its saves are done and it takes no more steps:
            self._restart.ready()  # a restart for a joining node need not wait for it
            self._restart.close()
        # The replicas' parameters, compared in the end agreement's own all-reduce.
        digest = self._train.replica_digest(parameters_only=True)
        end = runend.agree_and_mark(self.ctx, 0 if digest is None else digest)
        if not end.agreed:
            # The rescue stays armed and the node's memory snapshots stay: the error
            # commits the last step to node memory (a peer's record of it included),
            # where the restart resumes from, instead of an older snapshot.
            raise _end_not_agreed()
        equal = None if digest is None else replica_check.report_end(
            self.ctx, digest, end.highest, end.lowest, self.step_count)
        # The end's record first, the teardown after: a node lost from here on takes
        # less of the record with it.
        weights = None
        if self.ctx.is_writer and not self.sharded:  # the end's weights, once
            weights = param_digest(unwrap(self.model))
            log.info("params.digest", param_digest=weights)
        if self.ctx.rank == 0:
            session.log_finished(**{"final_step": self.step_count, "epoch": self.epoch,
                                    "param_digest": weights,
                                    "replicas_equal": equal,
                                    "snapshot_step": self._durable_step,
                                    **finished})
        # This node's memory goes before the record stream ends: that waits (bounded)
        # for the other nodes, and a node lost now never answers.
        self._rescuer.disarm()
        self._node_memory.close()
        self._rescuer.close()


def _finite(loss: Any) -> float | None:
    """The loss to record with a snapshot: a finite number, else none."""
    value = loss_value(loss)
    return value if value is not None and math.isfinite(value) else None


def _end_not_agreed() -> RunEndNotAgreed:
    return RunEndNotAgreed(
        "the run's end was not agreed: a peer rank failed, or did not reach close() "
        f"within {runend.AGREEMENT_TIMEOUT_S:.0f} s (run.end_not_agreed says which); the "
        "launcher restarts the workers, which resume from the newest snapshot and finish "
        "the run")


def _reduce_in_fixed_order(model: nn.Module) -> None:
    """``dist.fixed_order_reduction``: DDP's gradient sums in rank order from the first
    step (worker/exact_reduce.py); said once, and why not when the model keeps its own."""
    from elastictrain.worker.exact_reduce import use_fixed_order_reduction

    if use_fixed_order_reduction(model):
        log.info("dist.reduction_order", fixed=True)
    else:
        log.warning("dist.reduction_order", fixed=False,
                    reason="not a DistributedDataParallel model, or it has a comm hook "
                           "of its own: its gradients are reduced as before")
