"""ElasticSampler: a resumable, world-size-agnostic distributed sampler.

The order of an epoch depends only on ``(seed, epoch)``: a permutation of
``range(dataset_len)`` (or the identity with ``shuffle=False``). The sampler's
state is a *global cursor*: how many samples of that order the whole job has
consumed this epoch. Whatever the world size, the samples not yet consumed,
``order[cursor:]``, are dealt round-robin to the current ranks: rank ``r``
takes positions ``r, r + W, r + 2W, …``. After each step every rank has
consumed ``batch_size`` samples, so the job has consumed the next
``batch_size * W`` positions and the cursor advances by that much. A resume
at any world size therefore continues with exactly the unseen samples.

End of epoch: when the remaining count ``R`` is not a multiple of ``W``,
ranks would get unequal shares and DDP would hang on the rank with fewer
batches. ``drop_last=False`` (default) pads the deal with the epoch's first
``W - R % W`` samples again (so those few are seen twice);
``drop_last=True`` drops the last ``R % W`` samples of the epoch instead.
Either way at most ``W - 1`` samples per epoch are affected, and
:meth:`ElasticSampler.epoch_padding` says how many.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from elastictrain.errors import ResumeMismatchError


class ElasticSampler(Sampler[int]):
    """Deals the unseen samples of an epoch to the current ranks; see module docstring.

    Args:
        dataset_len: number of samples in the dataset.
        batch_size: samples per rank per step (the DataLoader's ``batch_size``).
        rank: this rank; world_size: current number of ranks.
        seed: base seed of the per-epoch permutation.
        shuffle: permute each epoch (else the identity order).
        drop_last: drop, rather than pad, the uneven tail of an epoch.
    """

    def __init__(
        self,
        dataset_len: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if dataset_len <= 0 or batch_size <= 0:
            raise ValueError(f"dataset_len={dataset_len} and batch_size={batch_size} must be > 0")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.cursor = 0

    # -- order and sharding -----------------------------------------------------------
    def epoch_order(self, epoch: int | None = None) -> list[int]:
        """The job-wide sample order of ``epoch`` (independent of the world size)."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return list(range(self.dataset_len))
        generator = torch.Generator()
        generator.manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.dataset_len, generator=generator).tolist()

    def _dealt(self) -> list[int]:
        order = self.epoch_order()
        remaining = order[self.cursor:]
        extra = len(remaining) % self.world_size
        if extra == 0:
            return remaining
        if self.drop_last:
            return remaining[: len(remaining) - extra]
        # Pad from the start of the epoch's order, not of what remains: the padding is
        # then the same wherever a same-size job resumed, which keeps resume bit-exact.
        pad = self.world_size - extra
        return remaining + (order * pad)[:pad]

    def __iter__(self) -> Iterator[int]:
        return iter(self._dealt()[self.rank :: self.world_size])

    def __len__(self) -> int:
        return len(self._dealt()) // self.world_size

    def epoch_padding(self) -> int:
        """Samples repeated (positive) or dropped (negative) at this epoch's end."""
        extra = (self.dataset_len - self.cursor) % self.world_size
        if extra == 0:
            return 0
        return -extra if self.drop_last else self.world_size - extra

    # -- progress -----------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``; a no-op for the epoch already in progress (resume)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.cursor = 0

    def advance(self, per_rank_samples: int | None = None) -> None:
        """Record one completed step: every rank consumed ``per_rank_samples`` (default
        ``batch_size``), so the job consumed that many times the world size."""
        n = self.batch_size if per_rank_samples is None else per_rank_samples
        self.cursor = min(self.dataset_len, self.cursor + n * self.world_size)

    @property
    def epoch_done(self) -> bool:
        return len(self) == 0

    def set_world(self, rank: int, world_size: int) -> None:
        """Re-shard the rest of the epoch over a new world (after an elastic restart)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.rank, self.world_size = rank, world_size

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "dataset_len": self.dataset_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved global cursor; the world size may differ.

        Raises:
            ResumeMismatchError: the dataset length or seed differ from the snapshot's.
        """
        if state["dataset_len"] != self.dataset_len:
            raise ResumeMismatchError(
                f"dataset has {self.dataset_len} samples but the snapshot was taken with "
                f"{state['dataset_len']}; fix: resume with the same dataset, or start a new run "
                "in a fresh storage location"
            )
        if state["seed"] != self.seed or state["shuffle"] != self.shuffle:
            raise ResumeMismatchError(
                f"sampler seed/shuffle {self.seed}/{self.shuffle} differ from the snapshot's "
                f"{state['seed']}/{state['shuffle']}; fix: use the same seed to resume"
            )
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
