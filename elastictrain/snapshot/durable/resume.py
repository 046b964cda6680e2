"""What a restore does with the snapshot it loaded: refuse one of another dataset,
apply it to the training objects, count the steps the restart lost, and report the
resume (``snapshot.loaded``, ``resume``). Loading the newest verified snapshot is the
saver's (snapshot/durable/restore.py, snapshot/sharded/restore.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from elastictrain.core.log import bind_step, get_logger
from elastictrain.snapshot.durable.restore import LoadedSnapshot
from elastictrain.snapshot.state import replica_check
from elastictrain.snapshot.state.training_state import TrainingState
from elastictrain.worker.dist import DistContext

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


@dataclass(frozen=True)
class MemoryOutcome:
    """What the failures since the last attempt were (None without a memory tier)."""

    memory_kept: bool | None = None  # every node kept its memory tier
    rescued: bool | None = None  # this restore resumes a rescue


def apply_and_report(loaded: LoadedSnapshot | None, train: TrainingState, ctx: DistContext,
                     previous_high: int | None, outcome: MemoryOutcome, restore_mode: str,
                     started: float) -> ResumeInfo:
    """Apply ``loaded`` (None: a fresh start) and log the resume.

    Args:
        previous_high: the highest step this rank reached before the restart, if known.
        started: ``time.perf_counter()`` when the restore began.
    """
    if loaded is not None:  # before anything is applied or trained
        train.check_dataset(loaded.payload)
    if loaded is None:
        log.info("resume", from_step=None, lost_steps=previous_high or 0,
                 memory_kept=outcome.memory_kept, rescued=outcome.rescued)
        return ResumeInfo(None, train.epoch, None, ctx.world_size, previous_high or 0)
    step, payload = loaded.step, loaded.payload
    rng_rule = train.apply(payload)
    digest = train.replica_digest()
    if digest is not None:  # every rank holds what every other one does, or all stop
        replica_check.check(ctx, digest, f"after restoring step {step}")
    lost = None if previous_high is None else max(0, previous_high - step)
    info = ResumeInfo(step, train.epoch, int(payload["world_size"]), ctx.world_size, lost,
                      loaded.tier)
    bind_step(step)
    log.info("snapshot.loaded", snapshot_step=step, size_bytes=loaded.size_bytes,
             restore_mode=restore_mode, tier=loaded.tier, peer_rank=loaded.peer_rank,
             duration_s=round(time.perf_counter() - started, 4))
    log.info("resume", from_step=step, lost_steps=lost, epoch=info.epoch, tier=loaded.tier,
             peer_rank=loaded.peer_rank,
             memory_kept=outcome.memory_kept, rescued=outcome.rescued,
             state_digest=None if digest is None else f"{digest:08x}",
             saved_world_size=info.saved_world_size, world_size=info.world_size,
             world_size_changed=info.saved_world_size != info.world_size,
             **train.resume_fields(payload, rng_rule))
    if payload.get("at_close"):
        log.warning("resume.run_finished", snapshot_step=step,
                    message=f"this run already ended at step {step} (the snapshot close() "
                            "took at its end): a loop that trains to that step has nothing "
                            "left to do; to train further, raise its step or epoch count; "
                            "to start over, give a new storage location")
    return info
