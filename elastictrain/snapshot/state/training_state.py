"""The training loop's objects and position, as a snapshot holds them: what a save
takes (``payload``, ``meta``) and what a restore applies (``apply``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from elastictrain.core.config import ChecksumAlgorithm
from elastictrain.core.errors import ConfigError
from elastictrain.snapshot.format.manifest import SnapshotMeta
from elastictrain.snapshot.format.views import InPlace
from elastictrain.snapshot.state import replica_check
from elastictrain.snapshot.state.rank_state import RankState, saved_names
from elastictrain.snapshot.state.rng import capture_rng, reseed_for_new_world, restore_rng
from elastictrain.worker.bucket_layout import BucketLayout
from elastictrain.worker.data import ElasticSampler
from elastictrain.worker.dist import DistContext


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP / FSDP-style wrappers and ``torch.compile``."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


class TrainingState:
    """Model, optimizer, scheduler, scaler and sampler, with the position: step, epoch
    and the user's ``extras``; and each rank's own objects and values (``ranked``).

    Args:
        ranked: the per-rank objects (``state=``) and ``rank_extras``.
        ctx: this attempt's process group (its world size goes into every snapshot).
        run_id, checksum: recorded in every snapshot's manifest.
        saver_holds_model: the saver takes (and loads) model and optimizer state
            itself; the payload holds the rest only.
    """

    def __init__(self, model: nn.Module, optimizer: Any | None, scheduler: Any | None,
                 scaler: Any | None, sampler: ElasticSampler | None, *, ctx: DistContext,
                 run_id: str, checksum: ChecksumAlgorithm, saver_holds_model: bool,
                 ranked: RankState | None = None) -> None:
        self.model, self.optimizer = model, optimizer
        self.ranked = ranked if ranked is not None else RankState(None)
        self.scheduler, self.scaler = scheduler, scaler
        self.sampler = sampler
        self.step = 0
        self.attempt: int | None = None  # the job's attempt (snapshot/state/attempt.py), if agreed
        # The loop's loss at the step saved (this rank's; None: the loop gives none):
        # what a restore's first steps are compared with (sense_check.py).
        self.loss: float | None = None
        self.extras: dict[str, Any] = {}
        self.buckets = BucketLayout(model)  # DDP's, recorded and restored: exact resumes
        self._epoch = 0
        self._ctx = ctx
        self._run_id, self._checksum = run_id, checksum
        self._saver_holds_model = saver_holds_model

    @property
    def epoch(self) -> int:
        """The sampler owns the epoch when there is one (it orders the epoch's samples)."""
        return self.sampler.epoch if self.sampler is not None else self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        if self.sampler is not None:
            self.sampler.set_epoch(value)
        else:
            self._epoch = value

    # -- what a save takes ---------------------------------------------------------------
    def rank_entry(self) -> dict[str, Any]:
        """This rank's entry of the list a save gathers: its RNG states and, when it has
        any, its per-rank state (``rank_state``)."""
        entry = capture_rng()
        held = self.ranked.capture()
        if held is not None:
            entry["rank_state"] = held
        return entry

    def payload(self, rng: list[dict[str, Any]], *, at_close: bool = False) -> dict[str, Any]:
        """Everything to save (``rng``: every rank's RNG state), but model and optimizer
        when the saver takes those itself. ``at_close``: the save close() takes of the
        step the run ends at, which a relaunch recognises as the end."""
        common = {
            "step": self.step,
            "epoch": self.epoch,
            "world_size": self._ctx.world_size,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "rng": rng,
            "extras": dict(self.extras),
            "at_close": at_close,
        }
        if self.loss is not None:  # absent otherwise: such a payload is as it always was
            common["loss"] = self.loss
        layout = self.buckets.for_snapshot()
        if layout is not None:  # likewise
            common["ddp_buckets"] = layout
        held = saved_names(rng)
        if held is not None:  # absent otherwise: such a payload is as it always was
            common["rank_state"] = held
        if self._saver_holds_model:
            return {"format": 2, **common}
        return {
            "format": 1,
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            **common,
        }

    def meta(self) -> SnapshotMeta:
        return SnapshotMeta(
            run_id=self._run_id,
            step=self.step,
            epoch=self.epoch,
            world_size=self._ctx.world_size,
            checksum_algorithm=self._checksum,
            dataset_len=self.sampler.dataset_len if self.sampler is not None else None,
            global_batch_size=(self.sampler.global_batch if self.sampler is not None
                               else None),
            attempt=self.attempt,
            loss=self.loss,
        )

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """The optimizer's state tensors (none before its first step)."""
        return [v for state in getattr(self.optimizer, "state", {}).values()
                for v in state.values() if isinstance(v, torch.Tensor)]

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor a snapshot holds (their version counters tell a rescue whether
        the failed step changed any)."""
        model = list(unwrap(self.model).state_dict(keep_vars=True).values())
        return model + self.optimizer_tensors()

    def step_changed_ptrs(self) -> frozenset[int]:
        """``data_ptr()`` of what only the optimizer's step changes: parameters and
        optimizer state (what a save may copy behind)."""
        ptrs = {p.data_ptr() for p in unwrap(self.model).parameters()}
        ptrs.update(t.data_ptr() for t in self.optimizer_tensors())
        return frozenset(ptrs)

    # -- what a restore applies ----------------------------------------------------------
    def check_dataset(self, saved_state: dict[str, Any]) -> None:
        """Refuse a snapshot of other data (ResumeMismatchError: another fingerprint or
        length) before anything is applied or trained."""
        if self.sampler is not None:
            saved = saved_state.get("sampler")
            if saved is not None:  # none at all: apply() says what to do
                self.sampler.check_saved(saved)
        self.ranked.check_resumable(saved_state, self._ctx.world_size)

    def in_place(self) -> InPlace:
        """The model's tensors as targets a local restore reads straight into (the copy
        ``load_state_dict`` would make, and fresh memory for it, saved); checks that
        would refuse the snapshot run first, on its structure, so a refused resume
        leaves the model as it was (docs/restore.md)."""
        targets = {("model", key): tensor
                   for key, tensor in unwrap(self.model).state_dict().items()}
        return InPlace(targets, self.check_dataset)

    def apply(self, payload: dict[str, Any]) -> str:
        """Load ``payload`` into every object and take its position; returns the RNG
        rule: ``restored`` (same world size) or ``reseeded``."""
        names = ["scheduler", "scaler"]
        if not self._saver_holds_model:
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
            self.sampler.set_world(self._ctx.rank, self._ctx.world_size)
            if self.sampler.epoch_done:
                # Saved at its epoch's last step: the loop goes on with the next epoch,
                # as the uninterrupted run did, never with an empty one.
                self.sampler.set_epoch(self.sampler.epoch + 1)
        else:
            self._epoch = int(payload["epoch"])
        self.step = int(payload["step"])
        self.extras = dict(payload.get("extras") or {})
        self.buckets.restore(payload.get("ddp_buckets"))
        rng_states = payload["rng"]
        # RNG last: building the model and loading state may consume random numbers.
        # The per-rank objects after it: loading draws none, and what they hold (a
        # loader's own generators) is theirs.
        rank = self._ctx.rank
        own = rng_states[rank] if rank < len(rng_states) else None
        if own is not None and len(rng_states) == self._ctx.world_size:
            restore_rng(own)
            rule = "restored"
        else:
            reseed_for_new_world(rng_states[0], self.step, rank)
            rule = "reseeded"
        self.ranked.apply(own, payload.get("rank_state"), len(rng_states),
                          self._ctx.world_size)
        return rule

    def replica_digest(self, *, parameters_only: bool = False) -> int | None:
        """The digest every rank of replicated state shares (snapshot/state/replica_check.py):
        of everything a snapshot holds of the model and optimizer, or of the parameters
        alone (``parameters_only``: after training, when buffers may differ per rank, as
        BatchNorm's do under ``DistributedDataParallel(broadcast_buffers=False)``). None
        for sharded state, which differs per rank by design."""
        if self._saver_holds_model:
            return None
        model = unwrap(self.model)
        if parameters_only:
            return replica_check.state_digest(dict(model.named_parameters()), None, self.step)
        return replica_check.state_digest(
            model.state_dict(),
            self.optimizer.state_dict() if self.optimizer is not None else None, self.step)

    def resume_fields(self, payload: dict[str, Any], rng_rule: str) -> dict[str, Any]:
        """Batch policy and RNG rule of a resume, for the ``resume`` event."""
        fields: dict[str, Any] = {"rng": rng_rule}
        if self.sampler is not None:
            fields.update(self.sampler.resume_fields(payload["sampler"]))
        return fields
