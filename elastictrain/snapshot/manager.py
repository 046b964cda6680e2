"""SnapshotManager: periodic snapshots and verified restore for a DDP training loop.

Call order (every rank runs the same calls)::

    manager = SnapshotManager(url, model=ddp_model, optimizer=opt, sampler=sampler, ...)
    resume = manager.restore()      # (rank 0) list → (all) read + verify + load → agree
    for batch in loader:
        ...optimizer.step()
        manager.step()              # advance; when due: (all) gather RNG → (rank 0)
                                    # stage, then persist → commit → prune in the background
    manager.close()                 # wait for the save in flight

Snapshots are taken at step boundaries only, so every rank decides the same:
step triggers are deterministic; time triggers and preemption notices
(``elastictrain.preempt``) are agreed with one small all-reduce per step. On an
agreed notice ``step()`` takes a final snapshot of that step and exits 75.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from elastictrain import preempt, watchdog
from elastictrain.config import SnapshotConfig, StorageConfig, validated
from elastictrain.data import ElasticSampler, check_dataset_len
from elastictrain.dist import DistContext
from elastictrain.env import WorkerEnv
from elastictrain.errors import ConfigError
from elastictrain.log import bind_step, get_logger
from elastictrain.snapshot.commit import SnapshotMeta
from elastictrain.snapshot.persister import SaveHandle
from elastictrain.snapshot.restore import load_newest
from elastictrain.snapshot.rng import capture_rng, reseed_for_new_world, restore_rng
from elastictrain.snapshot.saver import Saver
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
        config: snapshot policy; keyword overrides (``every_steps=…``) win over it.
        ctx: the process group (``elastictrain.init``); single-process if None.
        run_id: recorded in manifests; defaults to torchrun's run id.
        storage_options: passed to fsspec (credentials: never logged).
        progress_dir: local directory for a tiny per-rank step counter, used to
            report how many steps a restart lost. None disables it.
        clock: monotonic seconds for ``every_seconds`` (tests inject a fake one).
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
        progress_dir: str | Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        **overrides: Any,
    ) -> None:
        base = (config or SnapshotConfig()).model_dump()
        self.config: SnapshotConfig = validated(SnapshotConfig, **{**base, **overrides})
        env = WorkerEnv.from_environ()
        self.ctx = ctx or DistContext(env.rank, env.world_size, env.local_rank, "gloo",
                                      torch.device("cpu"), False)
        self.store = (open_store(storage, storage_options)
                      if isinstance(storage, (str, StorageConfig)) else storage)
        self.run_id = run_id or env.run_id
        self.model, self.optimizer = model, optimizer
        self.scheduler, self.scaler = scheduler, scaler
        self.sampler = sampler
        self.extras: dict[str, Any] = {}
        self.step_count = 0
        self._epoch = 0
        self._saver = Saver(self.store, self.config)
        self._last_handle: SaveHandle | None = None
        self._clock = clock
        self._last_save_time = clock()
        self._progress = _ProgressFile(progress_dir, self.ctx.rank) if progress_dir else None
        self._rng_rule = "none"
        self._preempt = preempt.current()

    # -- properties -------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.sampler.epoch if self.sampler is not None else self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        if self.sampler is not None:
            self.sampler.set_epoch(value)
        self._epoch = value

    # -- restore ----------------------------------------------------------------------
    @watchdog.busy("snapshot.restore")
    def restore(self) -> ResumeInfo:
        """Load the newest verified snapshot on every rank (or start fresh)."""
        started = time.perf_counter()
        if self.ctx.is_writer:
            self._saver.warm_up()  # a persister process starts while we load
        loaded = load_newest(self.store, self.ctx, self.config.restore_mode)
        step = loaded.step if loaded else None
        if loaded is not None and self.sampler is not None:
            # Before anything is applied or trained; every rank holds the same payload.
            saved = loaded.payload.get("sampler") or {}
            check_dataset_len(self.sampler.dataset_len, saved.get("dataset_len"))
        previous_high = self._progress.read() if self._progress else None
        if step is None:
            info = ResumeInfo(None, self.epoch, None, self.ctx.world_size, previous_high or 0)
            log.info("resume", from_step=None, lost_steps=previous_high or 0)
            return info
        assert loaded is not None
        payload = loaded.payload
        self._apply(payload)
        lost = None if previous_high is None else max(0, previous_high - step)
        info = ResumeInfo(step, self.epoch, int(payload["world_size"]), self.ctx.world_size, lost)
        bind_step(step)
        log.info("snapshot.loaded", snapshot_step=step, size_bytes=loaded.size_bytes,
                 restore_mode=self.config.restore_mode,
                 duration_s=round(time.perf_counter() - started, 4))
        log.info("resume", from_step=step, lost_steps=lost, epoch=info.epoch,
                 saved_world_size=info.saved_world_size, world_size=info.world_size,
                 world_size_changed=info.saved_world_size != info.world_size,
                 **self._resume_fields(payload))
        return info

    def _apply(self, payload: dict[str, Any]) -> None:
        unwrap(self.model).load_state_dict(payload["model"])
        for name in ("optimizer", "scheduler", "scaler"):
            target = getattr(self, name)
            if target is not None and payload.get(name) is not None:
                target.load_state_dict(payload[name])
        if self.sampler is not None:
            if payload.get("sampler") is None:
                raise ConfigError("the snapshot has no sampler state but a sampler was given; "
                                  "fix: resume with the same training script")
            self.sampler.load_state_dict(payload["sampler"])
            self.sampler.set_world(self.ctx.rank, self.ctx.world_size)
        self._epoch = int(payload["epoch"])
        self.step_count = int(payload["step"])
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
    def step(self, per_rank_samples: int | None = None) -> SaveHandle | None:
        """Record one completed optimizer step; save if one is due.

        Args:
            per_rank_samples: samples each rank consumed (default: the sampler's batch size).
        """
        self._saver.raise_if_failed()  # a background persist that gave up stops training here
        self.step_count += 1
        if self.sampler is not None:
            self.sampler.advance(per_rank_samples)
        bind_step(self.step_count)
        if self._progress is not None:
            self._progress.write(self.step_count)
        watchdog.beat(self.step_count)
        due, stop = self._save_due()
        if self.ctx.is_writer and not due and not self._saver.staging.prepared:
            # Staging slabs allocated off the loop now, so the first save blocks like the rest.
            self._saver.staging.prepare_async(self._state([capture_rng()] * self.ctx.world_size))
        if stop is not None:
            preempt.finish(stop, self)  # final snapshot of this step, then exit 75
        if due:
            return self.save()
        return None

    def _save_due(self) -> tuple[bool, preempt.StopRequest | None]:
        every = self.config.every_steps
        due = every is not None and self.step_count % every == 0
        if self._preempt is not None:
            return self._due_or_stop(due)
        if self.config.every_seconds is not None and not due:
            elapsed = self._clock() - self._last_save_time >= self.config.every_seconds
            due = self.ctx.agree_any(elapsed)  # rank clocks differ: agree on one decision
        return due, None

    def _due_or_stop(self, due: bool) -> tuple[bool, preempt.StopRequest | None]:
        """With preemption on, a notice may reach one rank only: it rides on the same
        single small all-reduce as the time trigger, every step."""
        assert self._preempt is not None
        seconds = self.config.every_seconds
        elapsed = (seconds is not None and not due
                   and self._clock() - self._last_save_time >= seconds)
        agreed = self.ctx.all_reduce_max([int(elapsed), *self._preempt.flags()])
        return due or bool(agreed[0]), self._preempt.agreed(agreed[1:])

    @watchdog.busy("snapshot.save")
    def save(self) -> SaveHandle:
        """Snapshot the current step now (all ranks must call it at the same step)."""
        started = time.perf_counter()
        rng = self.ctx.all_gather_object(capture_rng())
        self._last_save_time = self._clock()
        if not self.ctx.is_writer:
            return SaveHandle.completed(self.step_count)
        meta = SnapshotMeta(
            run_id=self.run_id,
            step=self.step_count,
            epoch=self.epoch,
            world_size=self.ctx.world_size,
            checksum_algorithm=self.config.checksum,
            dataset_len=self.sampler.dataset_len if self.sampler is not None else None,
            global_batch_size=self.sampler.global_batch if self.sampler is not None else None,
        )
        self._last_handle = self._saver.save(self._state(rng), meta, started)
        return self._last_handle

    def _state(self, rng: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "format": 1,
            "step": self.step_count,
            "epoch": self.epoch,
            "world_size": self.ctx.world_size,
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "rng": rng,
            "extras": dict(self.extras),
        }

    @watchdog.busy("snapshot.wait")
    def wait(self) -> None:
        """Block until the last save is durable (re-raises its failure)."""
        self._saver.wait()

    def close(self) -> None:
        """Wait for the save in flight and release the persister."""
        self._saver.close()


class _ProgressFile:
    """The highest step this rank reached, in a local file rewritten in place each step
    (a 20-byte pwrite, no fsync): after a crash the next attempt reads it to report
    how many steps were lost."""

    def __init__(self, directory: str | Path, rank: int) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._path = Path(directory) / f"progress-rank{rank}"
        self._fd: int | None = None

    def read(self) -> int | None:
        try:
            return int(self._path.read_text().strip() or "0")
        except (FileNotFoundError, ValueError):
            return None

    def write(self, step: int) -> None:
        if self._fd is None:
            self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._fd, f"{step:>20d}".encode(), 0)
