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
every node holds it and it is newer than the durable one (snapshot/memory.py).

Snapshots are taken at step boundaries only, so every rank decides the same:
step triggers are deterministic; time triggers, preemption notices
(``elastictrain.preempt``) and a background persist that gave up are agreed
with one small all-reduce per step where one is needed (preemption on, or a
time trigger); without it a failed persist is agreed at the next save, which
gathers it with the RNG states. So ``SnapshotWriteFailed`` is raised on every
rank at the same step. On an agreed notice ``step()`` takes a final snapshot of
that step and exits 75, or 76 when it could not be committed.

Built without ``ctx``/``config``, the manager takes the process group and the
settings from ``elastictrain.init()`` (or finds an initialised group itself).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from elastictrain import preempt, runend, runtime, watchdog
from elastictrain.config import SnapshotConfig, StorageConfig, load_settings, validated
from elastictrain.data import ElasticSampler, check_dataset_len
from elastictrain.dist import DistContext, find_context
from elastictrain.env import WorkerEnv
from elastictrain.errors import (
    EXIT_PREEMPTED,
    EXIT_PREEMPTED_UNSAVED,
    ConfigError,
    SnapshotWriteFailed,
)
from elastictrain.localfiles import make_private_dirs, open_private
from elastictrain.log import bind_step, get_logger
from elastictrain.snapshot import memory, rescue
from elastictrain.snapshot.commit import SnapshotMeta
from elastictrain.snapshot.digest import param_digest
from elastictrain.snapshot.interval import (
    FailureHistory,
    IntervalPolicy,
    failure_history,
    interval_steps,
)
from elastictrain.snapshot.onepass import InPlace
from elastictrain.snapshot.persister import SaveHandle
from elastictrain.snapshot.rescue import BoundaryRecord, read_record
from elastictrain.snapshot.restore import load_newest
from elastictrain.snapshot.rng import capture_rng, reseed_for_new_world, restore_rng
from elastictrain.snapshot.saver import Saver
from elastictrain.snapshot.sharded.restore import load_newest_sharded
from elastictrain.snapshot.sharded.save import ShardedSaver
from elastictrain.snapshot.sharded.state import has_dtensor_params
from elastictrain.storage import Store, open_store

log = get_logger("elastictrain.snapshot")


@dataclass(frozen=True)
class ResumeInfo:
    """What ``restore()`` found: ``from_step`` is None on a fresh start."""

    from_step: int | None
    epoch: int
    saved_world_size: int | None
    world_size: int
    lost_steps: int | None
    tier: str | None = None  # "memory" or "durable"; None on a fresh start

    @property
    def resumed(self) -> bool:
        return self.from_step is not None


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP / FSDP-style wrappers and ``torch.compile``."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


class SnapshotManager:
    """Saves and restores everything a training loop needs to resume exactly.

    Args:
        storage: a URL (local path, ``file://``, ``memory://``, ``s3://…``), a
            StorageConfig (URL, options, retries, multipart settings) or a Store.
        model: the (DDP-wrapped or plain) model; saved unwrapped.
        optimizer, scheduler, scaler: optional; anything with state_dict().
        sampler: the ElasticSampler whose global position is saved.
            A URL takes the other storage settings from ``Settings``.
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
            group is initialised (call ``elastictrain.init()`` first), or
            ``memory_every`` is set for a sharded model (replicated state only).
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
        config: SnapshotConfig | None = None,
        ctx: DistContext | None = None,
        run_id: str | None = None,
        storage_options: dict[str, Any] | None = None,
        progress_dir: str | Path | bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        sharded: bool | None = None,
        **overrides: Any,
    ) -> None:
        rt = runtime.current()
        settings = rt.settings if rt is not None else load_settings()
        base = (config or settings.snapshot).model_dump()
        self.config: SnapshotConfig = validated(SnapshotConfig, **{**base, **overrides})
        env = rt.env if rt is not None else WorkerEnv.from_environ()
        self.ctx = ctx or (rt.ctx if rt is not None else find_context(env))
        if isinstance(storage, str):
            storage = _storage_config(storage, settings.storage)
        self.store = (open_store(storage, storage_options)
                      if isinstance(storage, StorageConfig) else storage)
        # The run's events go beside these snapshots unless log.events_dir says where
        # (the rule: elastictrain.runtime), so status and goodput read what was passed.
        runtime.events_beside(storage if isinstance(storage, StorageConfig) else
                              settings.storage.model_copy(update={"url": self.store.url}))
        # This run's events directory: its earlier attempts feed the automatic interval.
        events_dir = rt.events_dir if rt is not None else settings.log.events_dir
        self.run_id = run_id or settings.run_id or env.run_id
        self.model, self.optimizer = model, optimizer
        self.scheduler, self.scaler = scheduler, scaler
        self.sampler = sampler
        self.extras: dict[str, Any] = {}
        self.step_count = 0
        self._epoch = 0
        self.sharded = has_dtensor_params(unwrap(model)) if sharded is None else sharded
        self._saver: Saver | ShardedSaver = (
            ShardedSaver(self.store, self.config, self.ctx, unwrap(model), optimizer)
            if self.sharded else Saver(self.store, self.config))
        self._memory_kept = False  # this node's memory directory predates this attempt
        self._memory_health = memory.Health()
        self._memory_dir: memory.MemoryTier | None = None
        self.memory_store, self._memory = self._memory_tier()
        self._unfenced_cost: float | None = None
        self._fence_hook = self._copy_behind_fence()
        self._last_handle: SaveHandle | None = None
        self._clock = clock
        self._last_save_time = clock()
        self._last_progress = clock()
        self._last_save_step = 0
        # The writer alone chooses an automatic interval; it rides the agreement below.
        history = (failure_history(events_dir)
                   if self.ctx.is_writer and (self.config.auto or self._memory_auto)
                   else None)
        self._history = history
        # With a memory tier, a durable snapshot matters only for the failures that took
        # a node's memory with them: the durable interval counts only those.
        self._auto = (IntervalPolicy(
            self.config.auto_mtbf_prior_s, self.config.auto_min_interval_s,
            self.config.auto_max_interval_s, self._durable_history(history), clock)
            if self.config.auto and history is not None else None)
        # memory_every="auto": the writer (local rank 0 of its node, so it writes memory
        # snapshots too) measures their cost and votes when one is due.
        self._memory_policy = (IntervalPolicy(
            self.config.auto_mtbf_prior_s, self.config.auto_min_interval_s,
            self.config.auto_max_interval_s, history.memory_view(), clock, tier="memory")
            if self._memory_auto and history is not None else None)
        self._last_memory_step = 0
        self._last_memory_time = clock()
        if progress_dir is None or progress_dir is True:
            progress_dir = events_dir  # beside this worker's events (local, per rank)
        self._progress = _ProgressFile(progress_dir, self.ctx.rank) if progress_dir else None
        self._rng_rule = "none"
        self._preempt = preempt.current()
        # Rescue (snapshot/rescue.py): this rank's record of every step boundary, opened
        # at the first step; the attempt it belongs to is in every record.
        self._restart_count = env.restart_count
        self._resumed_from = -1
        self._boundary: BoundaryRecord | None = None
        self._memory_step = -1  # the step of the last memory snapshot this attempt took
        self._memory_step_saved = False  # a memory save was started this attempt

    def _memory_tier(self) -> tuple[Store | None, Saver | None]:
        """This node's memory store (every rank reads it on restore) and, on the node's
        local rank 0, the Saver that writes it (keep 1, always in the background)."""
        every = self.config.memory_every
        if every is None:
            return None, None
        if self.sharded:
            raise ConfigError(
                f"snapshot.memory_every={every}: the memory tier holds replicated (DDP) state "
                "and this model is sharded; fix: unset snapshot.memory_every")
        try:
            tier = memory.open_memory_tier(self.config, self.run_id, self.store,
                                           sweep_idle=self.ctx.local_rank == 0)
        except OSError as exc:  # the node's tmpfs is full: run on durable snapshots
            self._memory_health.failed("memory directory", exc)
            return None, None
        self._memory_dir, self._memory_kept = tier, tier.kept
        if self.ctx.local_rank != 0:
            return tier.store, None
        # One try: a memory save that failed (a full tmpfs) is not retried with a
        # back-off the next one would wait for; the next memory save is the retry.
        config = self.config.model_copy(update={"keep": 1, "mode": "async",
                                                "max_consecutive_failures": 1})
        return tier.store, Saver(tier.store, config, tier="memory")

    def _durable_history(self, history: FailureHistory) -> FailureHistory:
        return history if self.config.memory_every is None else history.durable_view()

    def _agree_memory_outcome(self, loaded_memory_step: int | None) -> tuple[bool, bool] | None:
        """Whether every node kept its memory tier since the last attempt, and whether
        this restore resumes a rescue (None without a memory tier): what the failures
        since then were. A failure the memory tier covers leaves the durable interval
        alone, and a rescued one the memory interval too (docs/interval.md)."""
        if self._memory_dir is None:
            return None
        marks = self._memory_dir.boundary
        rescued = (loaded_memory_step is not None
                   and rescue.was_rescued(marks, loaded_memory_step))
        lost = self.ctx.all_reduce_max([int(not self._memory_kept), int(not rescued)])
        kept, rescued = not lost[0], not lost[1]
        if self._memory is not None:  # every rank has read its node's mark
            rescue.clear_marks(marks)
        if self._history is not None:
            self._history = self._history.resolved(kept, rescued)
            if self._auto is not None:
                self._auto.history = self._durable_history(self._history)
            if self._memory_policy is not None:
                self._memory_policy.history = self._history.memory_view()
        return kept, rescued

    def _copy_behind_fence(self) -> Any:
        """With ``overlap_copy``, the optimizer's step pre-hook that waits for the copies
        a save deferred (its handle, to remove at close); None otherwise ("auto" where
        copy behind cannot apply: sync mode, no torch.optim optimizer, a sharded model)."""
        setting = self.config.overlap_copy
        if setting is False:
            return None
        register = getattr(self.optimizer, "register_step_pre_hook", None)
        if setting == "auto" and (register is None or self.sharded or self.config.mode == "sync"):
            return None
        if register is None or self.sharded:
            problem = ("this model is sharded (sharded saves stage every rank at once)"
                       if self.sharded else "no torch.optim optimizer= was given (its "
                       "step is where the copy is awaited)")
            raise ConfigError(f"snapshot.overlap_copy=true: {problem}; fix: pass a "
                              "torch.optim optimizer or unset snapshot.overlap_copy")
        return register(lambda *_: self._fence())

    def _fence(self) -> None:
        """Before parameters or optimizer state change: the copies behind are done. The
        durable save's cost to the loop, for the automatic interval, ends here."""
        waited = self._saver.fence() if isinstance(self._saver, Saver) else 0.0
        if self._memory is not None:
            self._memory.fence()
        if self._auto is not None and self._unfenced_cost is not None:
            self._auto.observe_cost(self._unfenced_cost + waited)
        self._unfenced_cost = None

    def _deferred(self) -> frozenset[int]:
        """What a save copies behind: parameters and optimizer state (only the
        optimizer's step changes them); buffers and the rest are copied at once."""
        if self._fence_hook is None or not self._saver_copies_behind():
            return frozenset()
        ptrs = {p.data_ptr() for p in unwrap(self.model).parameters()}
        ptrs.update(t.data_ptr() for t in self._optimizer_tensors())
        return frozenset(ptrs)

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        """The optimizer's state tensors (none before its first step)."""
        return [v for state in getattr(self.optimizer, "state", {}).values()
                for v in state.values() if isinstance(v, torch.Tensor)]

    def _saver_copies_behind(self) -> bool:
        """False once a copy behind of either tier raced a change of its source
        (saver.py): the loop changes these tensors outside the optimizer's step."""
        memory_ok = self._memory is None or self._memory.copy_behind
        return isinstance(self._saver, Saver) and self._saver.copy_behind and memory_ok

    # -- properties -------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch in progress. The sampler owns it when there is one (it orders the
        epoch's samples); the manager only without a sampler."""
        return self.sampler.epoch if self.sampler is not None else self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        if self.sampler is not None:
            self.sampler.set_epoch(value)
        else:
            self._epoch = value

    # -- restore ----------------------------------------------------------------------
    @watchdog.busy("snapshot.restore")
    def restore(self) -> ResumeInfo:
        """Load the newest verified snapshot on every rank (or start fresh)."""
        started = time.perf_counter()
        self._fence()  # loading overwrites the parameters a copy behind may still read
        if self.ctx.is_writer:
            self._saver.warm_up()  # a persister process starts while we load
        if self._memory is not None:
            self._memory.warm_up()
        if isinstance(self._saver, ShardedSaver):  # loads model + optimizer itself
            loaded = load_newest_sharded(self.store, self.ctx, self._saver.group,
                                         unwrap(self.model), self.optimizer)
        else:
            loaded = load_newest(self.store, self.ctx, self.config.restore_mode,
                                 self.memory_store, self._in_place())
        step = loaded.step if loaded else None
        self._resumed_from = -1 if step is None else step
        if self._memory is not None:  # every rank has loaded: nobody reads it any more
            memory.drop_newer(self._memory.store, step)
        outcome = self._agree_memory_outcome(step if loaded and loaded.tier == "memory"
                                             else None)
        memory_kept, rescued = outcome if outcome is not None else (None, None)
        if loaded is not None and self.sampler is not None:
            # Before anything is applied or trained; every rank holds the same payload.
            saved = loaded.payload.get("sampler") or {}
            check_dataset_len(self.sampler.dataset_len, saved.get("dataset_len"))
        previous_high = self._progress.read() if self._progress else None
        if step is None:
            info = ResumeInfo(None, self.epoch, None, self.ctx.world_size, previous_high or 0)
            log.info("resume", from_step=None, lost_steps=previous_high or 0,
                     memory_kept=memory_kept, rescued=rescued)
            return info
        assert loaded is not None
        payload = loaded.payload
        self._apply(payload)
        lost = None if previous_high is None else max(0, previous_high - step)
        info = ResumeInfo(step, self.epoch, int(payload["world_size"]), self.ctx.world_size, lost,
                          loaded.tier)
        bind_step(step)
        log.info("snapshot.loaded", snapshot_step=step, size_bytes=loaded.size_bytes,
                 restore_mode=self.config.restore_mode, tier=loaded.tier,
                 duration_s=round(time.perf_counter() - started, 4))
        log.info("resume", from_step=step, lost_steps=lost, epoch=info.epoch, tier=loaded.tier,
                 memory_kept=memory_kept, rescued=rescued,
                 saved_world_size=info.saved_world_size, world_size=info.world_size,
                 world_size_changed=info.saved_world_size != info.world_size,
                 **self._resume_fields(payload))
        return info

    def _in_place(self) -> InPlace:
        """The model's tensors as targets a local restore reads straight into (the copy
        ``load_state_dict`` would make, and fresh memory for it, saved); checks that
        would refuse the snapshot run first, on its structure, so a refused resume
        leaves the model as it was (docs/restore.md)."""
        targets = {("model", key): tensor
                   for key, tensor in unwrap(self.model).state_dict().items()}

        def precheck(skeleton: Any) -> None:
            if self.sampler is not None:
                saved = skeleton.get("sampler") or {}
                check_dataset_len(self.sampler.dataset_len, saved.get("dataset_len"))

        return InPlace(targets, precheck)

    def _apply(self, payload: dict[str, Any]) -> None:
        names = ["scheduler", "scaler"]
        if not self.sharded:
            unwrap(self.model).load_state_dict(payload["model"])
            names.insert(0, "optimizer")
        for name in names:
            target = getattr(self, name)
            if target is not None and payload.get(name) is not None:
                target.load_state_dict(payload[name])
        if self.sampler is not None:
            if payload.get("sampler") is None:
                raise ConfigError("the snapshot has no sampler state but a sampler was given; "
                                  "fix: resume with the same training script")
            self.sampler.load_state_dict(payload["sampler"])
            self.sampler.set_world(self.ctx.rank, self.ctx.world_size)
        else:
            self._epoch = int(payload["epoch"])
        self.step_count = int(payload["step"])
        # The restored step is the last save: intervals count from it, not from step 0
        # (with every_steps="auto" the steps since step 0 made a wrong step time).
        self._last_save_step, self._last_save_time = self.step_count, self._clock()
        self._last_memory_step, self._last_memory_time = self.step_count, self._clock()
        self.extras = dict(payload.get("extras") or {})
        rng_states = payload["rng"]
        # RNG last: building the model and loading state may consume random numbers.
        if len(rng_states) == self.ctx.world_size:
            restore_rng(rng_states[self.ctx.rank])
            self._rng_rule = "restored"
        else:
            reseed_for_new_world(rng_states[0], self.step_count, self.ctx.rank)
            self._rng_rule = "reseeded"

    def _resume_fields(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Batch policy and RNG rule of a resume, for the ``resume`` event."""
        fields: dict[str, Any] = {"rng": self._rng_rule}
        if self.sampler is not None:
            fields.update(self.sampler.resume_fields(payload["sampler"]))
        return fields

    # -- the training loop's side ----------------------------------------------------
    def step(self, loss: Any = None) -> SaveHandle | None:
        """Record one completed optimizer step; save if one is due.

        Args:
            loss: this step's loss (float or 0-d tensor) for the periodic
                ``train.progress`` event; read only when that event is due.

        Raises:
            SnapshotWriteFailed: a background persist gave up; raised on every rank at
                the same step, after the step is recorded, so a loop that catches it
                goes on in lockstep.
        """
        self.step_count += 1
        if self.sampler is not None:
            self.sampler.advance()
        if self._rescues:  # first: a failure anywhere after this finds the boundary
            self._record_boundary()
        bind_step(self.step_count)
        if self._progress is not None:
            self._progress.write(self.step_count)
        watchdog.beat(self.step_count)
        self._report_progress(loss)
        due, stop, failed_step, memory_vote = self._decide()
        every_memory = self.config.memory_every
        memory_due = not due and (memory_vote if every_memory == "auto" else
                                  every_memory is not None
                                  and self.step_count % every_memory == 0)
        for saver, busy in ((self._saver if self.ctx.is_writer else None, due),
                            (self._memory, memory_due)):
            if saver is not None and not busy:
                saver.prepare_ahead(lambda: self._state([capture_rng()] * self.ctx.world_size))
        if stop is not None:
            self._stop_preempted(stop)
        if failed_step:
            self._raise_failed(failed_step)
        if due:
            try:
                return self.save()
            except SnapshotWriteFailed:
                # Raised on every rank alike (agreed in save()); a notice that arrived
                # while save() waited for the failing persist still gets its final save.
                stop = self._pending_stop()
                if stop is None:
                    raise
                self._stop_preempted(stop)
        if memory_due:
            self._save_memory()
        return None

    @property
    def _rescues(self) -> bool:
        return self.config.rescue and self._memory_dir is not None and not self.sharded

    def _record_boundary(self) -> None:
        """This step's boundary record. A node whose memory directory refuses it (full)
        goes on without the rescue until a record succeeds again: a rescue finds the
        record of the step it would commit, or skips."""
        assert self._memory_dir is not None
        try:
            if self._boundary is None:
                self._boundary = BoundaryRecord(self._memory_dir.boundary, self.ctx.rank,
                                                self._attempt(), self._held_tensors)
                rescue.arm(self._rescue)
            self._boundary.record(self.step_count)
        except OSError as exc:
            self._memory_health.failed("rescue boundary record", exc)
            return
        self._memory_health.ok("rescue boundary record")

    def _attempt(self) -> tuple[int, int, int]:
        return self.ctx.world_size, self._restart_count, self._resumed_from

    def _held_tensors(self) -> list[torch.Tensor]:
        """Every tensor a snapshot holds (their version counters tell a rescue whether
        the failed step changed any)."""
        model = list(unwrap(self.model).state_dict(keep_vars=True).values())
        return model + self._optimizer_tensors()

    def _rescue(self, error: BaseException) -> None:
        """On an uncaught error (runtime's excepthook): commit the last boundary to this
        node's memory tier if the state is still exactly that step's and every rank's
        RNG record of it is on this node; else log why not (docs/memory-tier.md#rescue)."""
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
        reason = self._rescue_refusal(record)
        rngs = [] if reason else [read_record(record.directory, rank, step, self._attempt())
                                  for rank in range(self.ctx.world_size)]
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
        if self._memory is not None:  # our own periodic memory save commits first
            self._memory.wait_in_flight(step)
        config = self.config.model_copy(update={"keep": 1, "mode": "sync",
                                                "overlap_copy": False})
        saver = Saver(self.memory_store, config, tier="memory")  # type: ignore[arg-type]
        try:
            saver.save(self._state(rngs), self._meta(), started)  # type: ignore[arg-type]
        finally:
            saver.close()
        rescue.mark_rescued(record.directory, step)
        log.info("snapshot.rescued", duration_s=round(time.perf_counter() - started, 4),
                 **fields)

    def _rescue_refusal(self, record: BoundaryRecord) -> str | None:
        """Why this rank's state is not exactly its last boundary's, or None."""
        if record.step != self.step_count:
            return f"the manager is at step {self.step_count}, its record at {record.step}"
        if not record.unchanged():
            return (f"parameters, buffers or optimizer state changed after step {record.step} "
                    "(the failure came after optimizer.step() or a buffer update)")
        if self._memory_step == record.step:  # its directory: one writer per step
            return f"a memory snapshot of step {record.step} was already taken"
        return None

    def _pending_stop(self) -> preempt.StopRequest | None:
        """A preemption notice on any rank, agreed now (every rank calls it together)."""
        if self._preempt is None:
            return None
        return self._preempt.agreed(self.ctx.all_reduce_max(self._preempt.flags()))

    def _report_progress(self, loss: Any) -> None:
        """A ``train.progress`` event at most every ``progress_every_s`` (the views' step
        rate and loss), so the training path never logs per step."""
        every = self.config.progress_every_s
        now = self._clock()
        if every is None or now - self._last_progress < every:
            return
        self._last_progress = now
        log.info("train.progress", loss=None if loss is None else round(float(loss), 6))

    def _decide(self) -> tuple[bool, preempt.StopRequest | None, int, bool]:
        """(save due, agreed stop, step of a failed save or 0, memory snapshot due under
        ``memory_every="auto"``): the same on every rank.

        Step triggers are deterministic. Clocks, notices, the writer's failed persist
        and its automatic memory interval differ between ranks: they ride one small
        all-reduce, on the steps where one is needed anyway (preemption on, a time
        trigger not already due, or an automatic memory interval). The step path stays
        collective-free otherwise: ``save`` agrees on a failure.
        """
        every = self.config.every_steps
        due = isinstance(every, int) and self.step_count % every == 0
        seconds = self.config.every_seconds
        elapsed: bool | None = None  # None: no time trigger to check at this step
        if (seconds is not None or self.config.auto) and not due:
            elapsed = self._time_due()
        if self._preempt is None and elapsed is None and not self._memory_auto:
            return due, None, 0, False
        notice = self._preempt.flags() if self._preempt is not None else []
        agreed = self.ctx.all_reduce_max([int(bool(elapsed)), self._failed_step(),
                                          int(self._memory_time_due()), *notice])
        stop = self._preempt.agreed(agreed[3:]) if self._preempt is not None else None
        return due or bool(agreed[0]), stop, agreed[1], bool(agreed[2])

    @property
    def _memory_auto(self) -> bool:
        return self.config.memory_every == "auto"

    def _memory_time_due(self) -> bool:
        """The writer's vote for a memory snapshot now (``memory_every="auto"``)."""
        if self._memory_policy is None:
            return False
        steps = self.step_count - self._last_memory_step
        since = self._clock() - self._last_memory_time
        step_time = since / steps if steps else None
        interval = self._memory_policy.evaluate(step_time_s=step_time)
        return step_time is not None and steps >= interval_steps(interval, step_time)

    def _time_due(self) -> bool:
        """This rank's vote for a save now: a fixed ``every_seconds`` that elapsed, or
        (the writer only) the automatic interval."""
        since = self._clock() - self._last_save_time
        seconds = self.config.every_seconds
        if isinstance(seconds, float) and since >= seconds:
            return True
        if self._auto is None:
            return False
        steps = self.step_count - self._last_save_step
        interval = self._auto.evaluate(step_time_s=since / steps if steps else None)
        if self.config.every_steps == "auto" and steps:
            return steps >= interval_steps(interval, since / steps)
        return since >= interval

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

    def _save(self, copy_behind: bool) -> SaveHandle:
        started = time.perf_counter()
        if self.ctx.is_writer or self.sharded:  # sharded: every rank persists
            self._saver.wait_in_flight(self.step_count)  # its outcome is agreed below
        with watchdog.busy("snapshot.save"):
            gathered = self.ctx.all_gather_object((capture_rng(), self._failed_step()))
            self._last_save_time = self._clock()
            self._last_save_step = self.step_count
            # A durable snapshot of this step is newer than any memory one: the
            # automatic memory interval counts from here too.
            self._last_memory_step, self._last_memory_time = self.step_count, self._clock()
            failed_step = gathered[0][1]
            if failed_step:
                self._raise_failed(failed_step)
            if not self.ctx.is_writer and not self.sharded:
                return SaveHandle.completed(self.step_count)
            rng = [state for state, _ in gathered]
            self._last_handle = (
                self._saver.save(self._state(rng), self._meta(), started)
                if isinstance(self._saver, ShardedSaver) else
                self._saver.save(self._state(rng), self._meta(), started,
                                 self._deferred() if copy_behind else frozenset()))
            if self._auto is not None:  # what the loop waited for: back-pressure + staging
                cost = time.perf_counter() - started
                if self._fence_hook is None:
                    self._auto.observe_cost(cost)
                else:  # + the wait for the copy behind, at the fence
                    self._unfenced_cost = cost
            return self._last_handle

    def _save_memory(self) -> None:
        """Snapshot this step to every node's memory (all ranks, same step): one RNG
        gather, then each node's local rank 0 stages and persists in the background.
        A failed memory persist is logged, never raised: durable storage is the truth."""
        started = time.perf_counter()
        self._last_memory_step, self._last_memory_time = self.step_count, self._clock()
        self._memory_step = self.step_count
        if self._memory is not None:
            self._memory.wait_in_flight(self.step_count)
        with watchdog.busy("snapshot.save"):
            rng = self.ctx.all_gather_object(capture_rng())
            if self._memory is None:
                return
            failure = self._memory.take_failure()
            if failure is not None:
                log.warning("snapshot.memory_failed", error=str(failure), tier="memory")
                self._memory_health.failed("memory snapshot", failure)
            elif self._memory_step_saved:  # the last one is done (waited for above)
                self._memory_health.ok("memory snapshot")
            self._memory_step_saved = True
            self._memory.save(self._state(rng), self._meta(), started, defer=self._deferred())
        if self._memory_policy is not None:  # what the loop waited for (copy behind: less)
            self._memory_policy.observe_cost(time.perf_counter() - started)

    def _meta(self) -> SnapshotMeta:
        return SnapshotMeta(
            run_id=self.run_id,
            step=self.step_count,
            epoch=self.epoch,
            world_size=self.ctx.world_size,
            checksum_algorithm=self.config.checksum,
            dataset_len=self.sampler.dataset_len if self.sampler is not None else None,
            global_batch_size=(self.sampler.global_batch if self.sampler is not None
                               else None),
        )

    def _stop_preempted(self, stop: preempt.StopRequest) -> NoReturn:
        """Final snapshot of this step, then exit on every rank: 75 if it committed,
        76 if not (``preempt.saved`` or ``preempt.failed`` says which).

        The save in flight commits first; its failure is logged and the final save
        is attempted anyway. The ranks then gather the writer's outcome, which also
        keeps every rank alive until the writer is done (the agent tears the group
        down as soon as one rank exits).
        """
        started = time.monotonic()
        if self.ctx.is_writer or self.sharded:
            try:
                self._saver.wait()
            except Exception as exc:  # the earlier save failing must not stop the final one
                log.error("preempt.inflight_failed", error=str(exc),
                          error_type=type(exc).__name__)
        waited = time.monotonic() - started
        reason: str | None = None
        try:
            self._save(copy_behind=False)  # the last snapshot: nothing may drop it
            self._saver.close()
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
        with watchdog.busy("preempt.final_snapshot"):  # peers wait here for the writer
            reasons = [r for r in self.ctx.all_gather_object(reason) if r is not None]
        now = time.monotonic()
        since_notice = stop.notice_age_s + (now - stop.agreed_at)
        fields = {"snapshot_step": self.step_count, "duration_s": round(since_notice, 3),
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

    def _state(self, rng: list[dict[str, Any]]) -> dict[str, Any]:
        """Everything but, when sharded, model and optimizer (every rank saves those)."""
        if self.sharded:
            return {"format": 2, **self._common_state(rng)}
        return {
            "format": 1,
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            **self._common_state(rng),
        }

    def _common_state(self, rng: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "step": self.step_count,
            "epoch": self.epoch,
            "world_size": self.ctx.world_size,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "rng": rng,
            "extras": dict(self.extras),
        }

    def wait(self) -> None:
        """Block until the last save is durable (re-raises its failure, on the writer)
        and the memory snapshot in flight, if any, is committed (never raises).

        A persist that keeps writing bytes is not a hang to the watchdog; one that
        writes nothing for ``watchdog.timeout_s`` is.
        """
        self._saver.wait()
        if self._memory is not None:
            self._memory.wait_in_flight(self.step_count)

    def close(self, **finished: Any) -> None:
        """Wait for the save in flight and release the persister (same watchdog rule);
        the writer logs the final parameters' digest (``params.digest``: equal digests,
        identical weights; replicated state only, a sharded model has no whole copy).

        The run finished: each node's memory snapshots are removed (only here: after a
        failure the restart needs them); the ranks agree that every one of them got here,
        so that a failure in teardown does not restart a finished run
        (``elastictrain.runend``); and rank 0 logs ``run.finished`` (final step, epoch,
        digest and ``finished``'s fields), the clean end that goodput, status and the
        automatic interval read; not when called while an error propagates.

        Args:
            finished: more fields for the ``run.finished`` event (e.g. ``final_loss``).
        """
        if self._fence_hook is not None:
            self._fence_hook.remove()
        if self._boundary is not None:
            rescue.disarm()
            self._boundary.close()
            self._boundary = None
        self._saver.close()
        if self._memory is not None:
            try:
                self._memory.close()
            except SnapshotWriteFailed as exc:  # durable storage holds the run's result
                log.warning("snapshot.memory_failed", error=str(exc), tier="memory")
            memory.remove_all(self._memory_dir)  # type: ignore[arg-type]
        elif self._memory_dir is not None:
            self._memory_dir.release()
        elif ("memory directory" in self._memory_health.degraded
              and self.ctx.local_rank == 0):
            memory.remove_if_ours(self.config, self.store.url)
        digest = None
        if self.ctx.is_writer and not self.sharded:
            digest = param_digest(unwrap(self.model))
            log.info("params.digest", param_digest=digest)
        runend.agree_and_mark(self.ctx)
        if self.ctx.rank == 0:
            runtime.log_finished(**{"final_step": self.step_count, "epoch": self.epoch,
                                    "param_digest": digest, **finished})


def _storage_config(url: str, configured: StorageConfig) -> StorageConfig:
    """``url`` with the configured storage settings; the configured storage options
    only for the same kind of storage (S3 credentials mean nothing to a local path)."""
    same_kind = _scheme(url) == _scheme(configured.url)
    return configured.model_copy(update={
        "url": url, "storage_options": configured.storage_options if same_kind else {}})


def _scheme(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"


class _ProgressFile:
    """The highest step this rank reached, in a local file rewritten in place each step
    (a 20-byte pwrite, no fsync): after a crash the next attempt reads it to report
    how many steps were lost."""

    def __init__(self, directory: str | Path, rank: int) -> None:
        make_private_dirs(Path(directory))
        self._path = Path(directory) / f"progress-rank{rank}"
        self._fd: int | None = None

    def read(self) -> int | None:
        try:
            return int(self._path.read_text().strip() or "0")
        except (FileNotFoundError, ValueError):
            return None

    def write(self, step: int) -> None:
        if self._fd is None:
            self._fd = open_private(self._path, os.O_WRONLY | os.O_CREAT)
        os.pwrite(self._fd, f"{step:>20d}".encode(), 0)
