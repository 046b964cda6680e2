"""Batch policy: how many samples one optimizer step trains, and how each rank splits them.

Two policies, chosen with ``ElasticSampler(global_batch_size=...)``:

* **per-rank** (``global_batch_size=None``, the default): every rank trains
  ``batch_size`` samples per optimizer step. The global batch is
  ``batch_size x W`` and changes with the world size ``W``; after a resume at
  another size the ``resume`` event reports ``saved_global_batch`` and
  ``global_batch``.
* **global** (``global_batch_size=G``): every optimizer step trains exactly
  ``G`` samples, whatever ``W``; each rank accumulates gradients over
  micro-batches of at most ``batch_size`` (the micro-batch ``m``).

The arithmetic of one optimizer step that trains ``n`` samples job-wide
(``n = G``, or less in the last step of an epoch) on ``W`` ranks:

1. The step takes the next ``n`` positions of the epoch's order and deals them
   round-robin: the ``i``-th goes to rank ``i mod W``, so rank ``r`` trains
   ``s_r = n // W + (1 if r < n % W else 0)`` samples.
2. Every rank runs the same number of micro-steps, ``A = ceil(n / (W m))``: DDP
   all-reduces in the last backward of the step, which every rank must reach.
3. Rank ``r`` splits its ``s_r`` samples, in order, into ``A`` micro-batches as
   equal as possible: the first ``s_r mod A`` hold ``s_r // A + 1``, the rest
   ``s_r // A``. None holds more than ``m`` (because ``A m W >= n``).
4. A micro-batch of ``k`` samples multiplies its mean loss by ``k W / n``.
   Summed over the micro-steps and averaged over the ranks by DDP, the
   gradient is the mean over the step's ``n`` samples: the same update for any
   ``W`` in exact arithmetic (floating-point sums run in another order).
5. The sampler's cursor advances by exactly ``n``.

*Reachable*: every micro-batch must hold at least one sample, ``n // W >= A``,
which holds exactly when ``n >= W`` and (``m >= 2`` or ``W`` divides ``n``).
An unreachable ``global_batch_size`` is a :class:`~elastictrain.core.errors.ConfigError`
naming the global batch, the world size and the per-rank batch.

Example, ``G = 48`` on ``W = 5`` ranks with ``m = 4``: shares 10, 10, 10, 9, 9;
``A = ceil(48 / 20) = 3``; ranks 0-2 train micro-batches of 4, 3, 3 and ranks
3-4 of 3, 3, 3; a micro-batch of 4 scales its loss by ``4 x 5 / 48``. With the
per-rank policy the same step is ``G = m W``: one micro-batch of ``m`` per
rank, loss scale 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastictrain.core.errors import ConfigError


@dataclass(frozen=True)
class StepShape:
    """How one optimizer step of ``samples`` job-wide samples runs on ``world_size`` ranks."""

    samples: int
    world_size: int
    micro_steps: int

    def share(self, rank: int) -> int:
        """Samples rank ``rank`` trains in this step (round-robin deal)."""
        return self.samples // self.world_size + (1 if rank < self.samples % self.world_size else 0)

    def micro_sizes(self, rank: int) -> list[int]:
        """Rank ``rank``'s micro-batch sizes, in order (as equal as possible)."""
        share = self.share(rank)
        small, extra = divmod(share, self.micro_steps)
        return [small + 1] * extra + [small] * (self.micro_steps - extra)

    def loss_scale(self, micro_size: int) -> float:
        """Factor on a micro-batch's mean loss so the step's gradient is the mean over
        all ``samples`` (DDP divides the summed gradients by the world size)."""
        return micro_size * self.world_size / self.samples


def micro_steps(samples: int, world_size: int, micro_batch: int) -> int:
    """``A = ceil(samples / (world_size * micro_batch))``."""
    return -(-samples // (world_size * micro_batch))


def reachable(samples: int, world_size: int, micro_batch: int) -> bool:
    """True when every rank has at least one sample in each of the step's micro-steps."""
    return samples // world_size >= micro_steps(samples, world_size, micro_batch)


def step_shape(samples: int, world_size: int, micro_batch: int) -> StepShape:
    """The shape of a step; the caller has checked :func:`reachable`."""
    if not reachable(samples, world_size, micro_batch):
        raise ValueError(f"a step of {samples} samples cannot run on {world_size} ranks "
                         f"with micro-batch {micro_batch}")
    return StepShape(samples, world_size, micro_steps(samples, world_size, micro_batch))


def check_global_batch(global_batch_size: int | None, world_size: int, batch_size: int,
                       name: str = "global_batch_size") -> None:
    """Raise ConfigError if ``global_batch_size`` cannot run on ``world_size`` ranks
    with per-rank (micro-)batch ``batch_size``; see the module docstring.

    Args:
        name: how the caller spells the setting (``--global-batch-size`` on a CLI).
    """
    if global_batch_size is None:
        return
    g, w, m = global_batch_size, world_size, batch_size
    where = f"{name}={g} is not reachable with world size {w} and per-rank batch {m}"
    if g < 1:
        raise ConfigError(f"{name}={g}: must be >= 1, or unset to keep the per-rank batch")
    if g < w:
        raise ConfigError(f"{where}: each of the {w} ranks must train at least one sample "
                          f"per step; fix: {name} >= {w}, or run on at most {g} ranks")
    if not reachable(g, w, m):
        a = micro_steps(g, w, m)
        lower, higher = g - g % w, g - g % w + w
        raise ConfigError(
            f"{where}: ranks would train {g // w + 1} or {g // w} samples in {a} micro-steps "
            f"of at most {m}, leaving some micro-steps empty; fix: a {name} divisible by "
            f"{w} ({lower} or {higher}), or a per-rank batch >= 2"
        )


def tail_samples(remaining: int, world_size: int, micro_batch: int, *, equal_shares: bool,
                 drop_last: bool) -> int:
    """Samples the last, short step of an epoch trains when ``remaining`` are left.

    ``remaining`` itself when that step can run; otherwise padded up (``drop_last``:
    cut down) to the nearest size that can. With ``equal_shares`` (the per-rank
    policy: a plain DataLoader must give every rank as many batches) that is a
    multiple of the world size; with a global batch any reachable size.
    """
    w = world_size
    if remaining == 0:
        return 0
    if equal_shares or micro_batch == 1:
        extra = remaining % w
        if extra == 0:
            return remaining
        return remaining - extra if drop_last else remaining + w - extra
    if remaining >= w:
        return remaining
    return 0 if drop_last else w


def global_batch(global_batch_size: int | None, world_size: int, batch_size: int) -> int:
    """Samples one full optimizer step trains job-wide under the policy."""
    return global_batch_size if global_batch_size is not None else batch_size * world_size
