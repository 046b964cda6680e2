"""ElasticSampler: a resumable, world-size-agnostic distributed sampler.

Order. The order of an epoch depends only on ``(seed, epoch)``: a permutation
of ``range(dataset_len)`` (the identity with ``shuffle=False``), never on the
world size.

State. A *global cursor*: how many positions of that order the whole job has
consumed this epoch. Whatever the world size, the samples not yet consumed,
``order[cursor:]``, are what the job trains next, so a resume at any world size
continues with exactly the unseen samples.

Steps. Each optimizer step takes the next ``n`` positions and deals them
round-robin over the current ``W`` ranks (the ``i``-th to rank ``i mod W``):
``n = batch_size x W`` with the per-rank batch policy, ``n =
global_batch_size`` with the global one (gradient accumulation; the arithmetic
is in :mod:`elastictrain.worker.batching`). ``advance()`` moves the cursor by exactly
``n``. With the per-rank policy rank ``r`` simply takes positions ``r, r + W,
r + 2W, ...``, so the sampler is a drop-in ``sampler=`` for a ``DataLoader``
with ``batch_size=batch_size``. With a global batch, pass
``batch_sampler=MicroBatchSampler(sampler)`` and iterate with
:func:`optimizer_steps`.

Epoch tail. The last step of an epoch trains what remains, ``R`` samples, if it
can. With the per-rank policy it can when ``W`` divides ``R``: otherwise ranks
would get unequal shares, a plain DataLoader would give them different numbers
of batches, and DDP would hang on the rank that runs out first. With a global
batch it can when every rank gets at least one sample per micro-batch (``R >=
W``, and ``W`` divides ``R`` if ``batch_size`` is 1). When it cannot,
``drop_last=False`` (default) pads that step up to the nearest size that can
run with the epoch's first samples, which are then trained twice in the epoch;
``drop_last=True`` leaves out the epoch's last samples instead. Either way fewer
than ``W`` samples per epoch are affected, and
:meth:`ElasticSampler.epoch_padding` says how many. The padding comes from the
epoch's start, not from what remains, so it is the same wherever a same-size job
resumed: a resume at the same world size stays bit-exact.

Virtual shards (``virtual_shards=V``, with a global batch): a step's ``n`` positions
are cut into ``V`` contiguous shards as equal as possible (empty ones left out), and
shard ``v`` goes to rank ``v mod W``, one micro-batch per shard, its mean loss scaled by
``k / n`` (``k``: its samples). No shard, size or scale depends on ``W``, nor does the
epoch's tail (trained as it is, or dropped whole with ``drop_last``), so with
:class:`elastictrain.worker.shard_sum.ShardSum` summing the shards' gradients in shard
order a run ends on the same bits at any world size (docs/elastic-resume.md).

Identity. A resume checks that the indices mean the same samples: the dataset's
length, the seed and, when the sampler was given one, the data's ``fingerprint``
(:attr:`elastictrain.worker.tokens.TokenDataset.fingerprint`, or any string that
changes with the data); a mismatch is a ``ResumeMismatchError`` before anything
is loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from elastictrain.core.errors import ConfigError, ResumeMismatchError
from elastictrain.worker.batching import (
    StepShape,
    check_global_batch,
    global_batch,
    step_shape,
    tail_samples,
)


@dataclass(frozen=True)
class Micro:
    """One micro-batch of an optimizer step, as seen by this rank.

    Attributes:
        index: position in the step, ``0 .. count - 1``.
        count: micro-batches in this step (the same on every rank).
        indices: the dataset indices this rank trains in it.
        loss_scale: factor on the micro-batch's mean loss (see :mod:`elastictrain.worker.batching`).
        shard: with virtual shards, the shard this micro-batch is (``0 .. V - 1``).
        seed: with virtual shards, a seed of the shard's own (the same on any rank and
            at any world size): :class:`~elastictrain.worker.shard_sum.ShardSum` draws
            the shard's random numbers (dropout) from it.
    """

    index: int
    count: int
    indices: tuple[int, ...]
    loss_scale: float
    shard: int | None = None
    seed: int | None = None

    @property
    def last(self) -> bool:
        """The micro-batch whose backward all-reduces (run the others under ``no_sync``)."""
        return self.index == self.count - 1


@dataclass(frozen=True)
class StepPlan:
    """This rank's part of one optimizer step."""

    start: int
    shape: StepShape
    micros: tuple[Micro, ...]


class ElasticSampler(Sampler[int]):
    """Deals the unseen samples of an epoch to the current ranks; see module docstring.

    Args:
        dataset_len: number of samples in the dataset.
        batch_size: samples per rank per step (per-rank policy), or the largest
            micro-batch (global policy); the DataLoader's ``batch_size``.
        rank: this rank; world_size: current number of ranks.
        seed: base seed of the per-epoch permutation.
        shuffle: permute each epoch (else the identity order).
        drop_last: drop, rather than pad, the uneven tail of an epoch.
        global_batch_size: keep this many samples per optimizer step at any world
            size (gradient accumulation); None keeps the per-rank batch.
        fingerprint: what the indices refer to (``TokenDataset.fingerprint``); saved,
            and a resume with another one is refused. None: the length alone is checked.
        virtual_shards: cut each step into this many shards that do not depend on the
            world size (needs ``global_batch_size``; see the module docstring), for
            gradients summed in a fixed order by ``ShardSum``.

    Raises:
        ConfigError: ``global_batch_size`` is not reachable with this world size
            and batch size (the message names the three numbers and the fix).
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
        global_batch_size: int | None = None,
        fingerprint: str | None = None,
        virtual_shards: int | None = None,
    ) -> None:
        if dataset_len <= 0 or batch_size <= 0:
            raise ValueError(f"dataset_len={dataset_len} and batch_size={batch_size} must be > 0")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.virtual_shards = virtual_shards
        if virtual_shards is None:
            check_global_batch(global_batch_size, world_size, batch_size)
        else:
            check_virtual_shards(virtual_shards, global_batch_size, batch_size)
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.global_batch_size = global_batch_size
        self.fingerprint = fingerprint
        self.epoch = 0
        self.cursor = 0
        self._order: tuple[int, list[int]] | None = None  # (epoch, order), one cached

    # -- order and sharding -----------------------------------------------------------
    def epoch_order(self, epoch: int | None = None) -> list[int]:
        """The job-wide sample order of ``epoch`` (independent of the world size)."""
        epoch = self.epoch if epoch is None else epoch
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.dataset_len, generator=generator).tolist()
        else:
            order = list(range(self.dataset_len))
        self._order = (epoch, order)
        return order

    @property
    def global_batch(self) -> int:
        """Samples a full optimizer step trains job-wide at the current world size."""
        return global_batch(self.global_batch_size, self.world_size, self.batch_size)

    def _step_sizes(self) -> Iterator[tuple[int, int]]:
        """``(start, n)`` of each remaining step of the epoch: ``n`` samples job-wide,
        the tail's padding included (its dropped samples excluded)."""
        start, full = self.cursor, self.global_batch
        while self.dataset_len - start >= full:
            yield start, full
            start += full
        tail = self._tail(self.dataset_len - start)
        if tail > 0:
            yield start, tail

    def _tail(self, remaining: int) -> int:
        if self.virtual_shards is not None:  # any world size runs it: nothing padded
            return 0 if self.drop_last else remaining
        return tail_samples(remaining, self.world_size, self.batch_size,
                            equal_shares=self.global_batch_size is None, drop_last=self.drop_last)

    def steps(self) -> Iterator[StepPlan]:
        """This rank's remaining optimizer steps of the epoch, from the cursor."""
        order = self.epoch_order()
        for start, n in self._step_sizes():
            # Padding comes from the epoch's start (see the module docstring).
            over = max(0, start + n - self.dataset_len)
            positions = order[start : start + n] + [order[i % len(order)] for i in range(over)]
            if self.virtual_shards is not None:
                yield self._sharded_step(start, positions)
                continue
            mine = positions[self.rank :: self.world_size]
            shape = step_shape(n, self.world_size, self.batch_size)
            sizes = shape.micro_sizes(self.rank)
            micros, offset = [], 0
            for i, size in enumerate(sizes):
                micros.append(Micro(i, len(sizes), tuple(mine[offset : offset + size]),
                                    shape.loss_scale(size)))
                offset += size
            yield StepPlan(start, shape, tuple(micros))

    def _sharded_step(self, start: int, positions: list[int]) -> StepPlan:
        """This rank's virtual shards of the step whose ``positions`` start at ``start``."""
        assert self.virtual_shards is not None
        n, w = len(positions), self.world_size
        bounds = shard_bounds(n, self.virtual_shards)
        mine = shards_of(self.rank, len(bounds), w)
        micros = tuple(
            Micro(i, len(mine), tuple(positions[bounds[v][0]:bounds[v][1]]),
                  (bounds[v][1] - bounds[v][0]) / n, shard=v,
                  seed=shard_seed(self.seed, self.epoch, start, v))
            for i, v in enumerate(mine))
        return StepPlan(start, StepShape(n, w, -(-len(bounds) // w)), micros)

    def __iter__(self) -> Iterator[int]:
        return iter([i for plan in self.steps() for m in plan.micros for i in m.indices])

    def __len__(self) -> int:
        if self.virtual_shards is not None:
            return sum(len(m.indices) for plan in self.steps() for m in plan.micros)
        return sum(step_shape(n, self.world_size, self.batch_size).share(self.rank)
                   for _, n in self._step_sizes())

    def epoch_padding(self) -> int:
        """Samples repeated (positive) or dropped (negative) at this epoch's end."""
        remaining = (self.dataset_len - self.cursor) % self.global_batch  # for the short step
        return self._tail(remaining) - remaining

    # -- progress -----------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``; a no-op for the epoch already in progress (resume)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.cursor = 0

    def advance(self) -> None:
        """Record one completed optimizer step: the cursor moves past exactly the
        samples the step trained (its ``n``; at the epoch's tail, to the end)."""
        start, n = next(self._step_sizes(), (self.dataset_len, 0))
        is_tail = self.dataset_len - start < self.global_batch
        self.cursor = self.dataset_len if is_tail else start + n

    @property
    def epoch_done(self) -> bool:
        return next(self._step_sizes(), None) is None

    def set_world(self, rank: int, world_size: int) -> None:
        """Re-shard the rest of the epoch over a new world (after an elastic restart).

        Raises:
            ConfigError: the global batch is not reachable at the new world size.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if self.virtual_shards is None:
            check_global_batch(self.global_batch_size, world_size, self.batch_size)
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
            "global_batch_size": self.global_batch_size,
            "fingerprint": self.fingerprint,
            "virtual_shards": self.virtual_shards,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved global cursor; the world size and batch policy may differ.

        Raises:
            ResumeMismatchError: the data (fingerprint, length) or the seed differ from
                the snapshot's.
        """
        self.check_saved(state)
        if state["seed"] != self.seed or state["shuffle"] != self.shuffle:
            raise ResumeMismatchError(
                f"sampler seed/shuffle {self.seed}/{self.shuffle} differ from the snapshot's "
                f"{state['seed']}/{state['shuffle']}; fix: use the same seed to resume"
            )
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])

    def check_saved(self, state: dict[str, Any]) -> None:
        """Refuse sampler state ``state`` taken over other data (ResumeMismatchError):
        another fingerprint, then another length."""
        saved = state.get("fingerprint")  # absent from state saved without one
        if saved != self.fingerprint:
            raise ResumeMismatchError(
                f"the data's fingerprint ({self.fingerprint or 'none'}) differs from the "
                f"snapshot's ({saved or 'none'}); fix: resume with the data the snapshot was "
                "taken with (a TokenDataset: the same shard files, names and sizes, in the "
                "same order, the same dtype and seq_len) and its fingerprint given to "
                "ElasticSampler, or start a new run in a fresh storage location")
        check_dataset_len(self.dataset_len, state.get("dataset_len"))

    def resume_fields(self, saved: dict[str, Any]) -> dict[str, Any]:
        """What a resume from sampler state ``saved`` changes, for the ``resume`` event."""
        saved_global = global_batch(saved.get("global_batch_size"), int(saved["world_size"]),
                                    int(saved["batch_size"]))
        first = next(self.steps(), None)
        return {
            "batch_policy": "per_rank" if self.global_batch_size is None else "global",
            "saved_global_batch": saved_global,
            "global_batch": self.global_batch,
            "global_batch_changed": saved_global != self.global_batch,
            "accumulation_steps": first.shape.micro_steps if first is not None else 0,
            "cursor": self.cursor,
            # Another shard count sums the gradients in another grouping: the run goes on,
            # no longer bit for bit the run it was.
            "virtual_shards": self.virtual_shards,
            "virtual_shards_changed": saved.get("virtual_shards") != self.virtual_shards,
        }


def shard_bounds(samples: int, shards: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each non-empty shard when ``samples`` positions are cut into
    ``shards`` contiguous pieces as equal as possible (the first ``samples % shards``
    one longer)."""
    small, extra = divmod(samples, shards)
    bounds, start = [], 0
    for v in range(shards):
        size = small + (1 if v < extra else 0)
        if size:
            bounds.append((start, start + size))
        start += size
    return bounds


def shard_place(shard: int, world_size: int) -> tuple[int, int]:
    """The rank that trains virtual shard ``shard`` of a step, and its position among
    that rank's shards: shards are dealt round-robin, ``v`` to rank ``v mod W``."""
    return shard % world_size, shard // world_size


def shards_of(rank: int, shards: int, world_size: int) -> list[int]:
    """The shards of a step of ``shards`` that ``rank`` trains, in order."""
    return [v for v in range(shards) if shard_place(v, world_size)[0] == rank]


def shard_seed(seed: int, epoch: int, start: int, shard: int) -> int:
    """A seed for one shard of one step: the same on any rank and at any world size."""
    return (((seed * 1_000_003 + epoch) * 1_000_003 + start) * 1_009 + shard) & (2**63 - 1)


def check_virtual_shards(shards: int, global_batch_size: int | None, batch_size: int) -> None:
    """Raise ConfigError when ``shards`` virtual shards cannot cut the global batch."""
    if global_batch_size is None:
        raise ConfigError(f"virtual_shards={shards} needs a global batch that does not "
                          "change with the world size; fix: also pass global_batch_size")
    if not 1 <= shards <= global_batch_size:
        raise ConfigError(f"virtual_shards={shards}: must be between 1 and the global "
                          f"batch ({global_batch_size})")
    largest = -(-global_batch_size // shards)
    if largest > batch_size:
        raise ConfigError(
            f"virtual_shards={shards} cuts global_batch_size={global_batch_size} into shards "
            f"of up to {largest} samples, more than the per-rank batch {batch_size}; fix: "
            f"virtual_shards >= {-(-global_batch_size // batch_size)}, or batch_size >= "
            f"{largest}")


def check_dataset_len(current: int, saved: int | None) -> None:
    """Raise ResumeMismatchError naming both lengths when they differ."""
    if saved is not None and int(saved) != current:
        raise ResumeMismatchError(
            f"dataset has {current} samples but the snapshot was taken with {saved}; fix: "
            "resume with the same dataset, or start a new run in a fresh storage location"
        )


class MicroBatchSampler(Sampler[list[int]]):
    """``batch_sampler=`` for a DataLoader: this rank's micro-batches, step after step.

    The plan is fixed when the DataLoader starts iterating (``iter(loader)``);
    :func:`optimizer_steps` groups the loaded micro-batches back into steps.
    """

    def __init__(self, sampler: ElasticSampler) -> None:
        self.sampler = sampler
        self.planned: list[StepPlan] = []

    def __iter__(self) -> Iterator[list[int]]:
        # Eager, not a generator: the plan must exist as soon as the DataLoader calls iter().
        self.planned = list(self.sampler.steps())
        return iter([list(m.indices) for plan in self.planned for m in plan.micros])

    def __len__(self) -> int:
        return sum(len(plan.micros) for plan in self.sampler.steps())


def optimizer_steps(loader: DataLoader[Any]) -> Iterator[list[tuple[Micro, Any]]]:
    """Iterate a DataLoader by optimizer step: each item lists ``(micro, batch)`` pairs.

    With ``batch_sampler=MicroBatchSampler(...)`` a step has one or more
    micro-batches; run the backward of all but the last under DDP's
    ``no_sync()`` and scale each mean loss by ``micro.loss_scale``. With a plain
    ``sampler=`` every batch is one step (one micro-batch, scale 1, its indices
    not known here: empty).
    """
    batch_sampler = loader.batch_sampler
    if not isinstance(batch_sampler, MicroBatchSampler):
        for batch in loader:
            yield [(Micro(0, 1, (), 1.0), batch)]
        return
    batches = iter(loader)  # calls iter(batch_sampler), which fixes the plan
    for plan in batch_sampler.planned:
        yield [(micro, next(batches)) for micro in plan.micros]
