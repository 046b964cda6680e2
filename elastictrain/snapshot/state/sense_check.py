"""After a restore, is the state sensible? A snapshot's checksum proves its bytes are the
bytes written, not that they make sense: a fault before the save, a node's wrong
arithmetic or a replica rebuilt wrong can write NaNs or a diverged model that verifies.

Right after a restore every rank checks that the restored tensors are finite; for the
next ``steps`` steps it watches the loss the loop passes to ``step(loss=…)``: a
non-finite loss on any rank shows at once; from the fifth watched step on, the median of
a rank's losses so far above ``loss_factor`` times the loss recorded with the snapshot
(rank 0's at the step it was taken) shows a diverged model. A loop that passes no loss gets the
tensor check again at the end of the window. Every verdict is agreed over the ranks in
one small all-reduce per watched step, so every rank stops together; nothing is read
or reduced outside the window.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from elastictrain.worker.dist import DistContext

_MILLI = 1000  # a loss ratio travels as an integer number of thousandths
_RATIO_CAP = 10**9  # a ratio this far above any factor is capped, not overflowed
_MIN_LOSSES = 5  # losses in the window before their median is compared


@dataclass(frozen=True)
class Watched:
    """The restore under watch."""

    step: int  # the snapshot's step
    tier: str  # "durable" or "memory"
    recorded_loss: float | None  # recorded with the snapshot (None: none was given)


@dataclass(frozen=True)
class Senseless:
    """What the watch saw, agreed over the ranks."""

    snapshot: Watched
    reason: str
    at_step: int
    loss: float | None  # this rank's loss that showed it, if a loss did


class RestoreWatch:
    """Watches the first ``steps`` steps after each restore (``steps=0``: never)."""

    def __init__(self, ctx: DistContext, steps: int, loss_factor: float) -> None:
        self._ctx = ctx
        self._steps = steps
        self._factor = loss_factor
        self.watched: Watched | None = None
        self._losses: list[float] = []
        self._any_loss = False

    @property
    def active(self) -> bool:
        return self.watched is not None

    def restored(self, step: int, tier: str, recorded_loss: Any,
                 tensors: Iterable[torch.Tensor]) -> Senseless | None:
        """Start watching the restore of ``step``; a restored tensor that is not finite
        on any rank is senseless at once (every rank calls this together)."""
        self.watched = None
        if self._steps == 0:
            return None
        recorded = recorded_loss if isinstance(recorded_loss, (int, float)) else None
        watched = Watched(step, tier, None if recorded is None else float(recorded))
        self.watched, self._losses, self._any_loss = watched, [], False
        (bad,) = self._ctx.all_reduce_max([int(not all_finite(tensors))])
        if bad:
            self.watched_over()
            return Senseless(watched, "a restored parameter or optimizer state is not finite "
                             "(NaN or infinite)", step, None)
        return None

    def observe(self, step: int, loss: Any,
                tensors: Callable[[], Iterable[torch.Tensor]]) -> Senseless | None:
        """One step of the window: ``loss`` as the loop gave it (None: not given);
        ``tensors`` is asked only at the window's end when no loss was ever given."""
        watched = self.watched
        if watched is None:
            return None
        value = loss_value(loss)
        nonfinite = value is not None and not math.isfinite(value)
        if value is not None and not nonfinite:
            self._losses.append(value)
        self._any_loss = self._any_loss or value is not None
        last = step >= watched.step + self._steps
        # The median of a few steps already shows a diverged model; one outlier batch
        # cannot trip it.
        ratio = self._ratio() if len(self._losses) >= min(_MIN_LOSSES, self._steps) else 0
        tensors_bad = int(last and not self._any_loss and not all_finite(tensors()))
        bad_loss, worst_ratio, bad_tensors = self._ctx.all_reduce_max(
            [int(nonfinite), ratio, tensors_bad])
        diverged = worst_ratio > self._factor * _MILLI
        if last or bad_loss or diverged:
            self.watched_over()
        if bad_loss:
            return Senseless(watched, "the loss is not finite (NaN or infinite) after the restore",
                             step, value)
        if bad_tensors:
            return Senseless(watched, "a parameter or optimizer state is not finite (NaN or "
                             "infinite) after the restore", step, None)
        if diverged:
            assert watched.recorded_loss is not None  # a ratio needs it
            return Senseless(
                watched, f"the loss after the restore is {worst_ratio / _MILLI:.3g}x the "
                f"{watched.recorded_loss:.4g} recorded with the snapshot (the limit: "
                f"{self._factor:g}x, snapshot.check_loss_factor)", step, value)
        return None

    def watched_over(self) -> None:
        self.watched = None
        self._losses = []

    def _ratio(self) -> int:
        """This rank's median loss in the window so far ÷ the recorded one, in thousandths;
        0 when there is nothing to compare (no positive recorded loss, no losses)."""
        recorded = self.watched.recorded_loss if self.watched is not None else None
        if not self._losses or recorded is None or not recorded > 0:
            return 0
        ratio = statistics.median(self._losses) / recorded
        return int(min(ratio, _RATIO_CAP) * _MILLI)


def loss_value(loss: Any) -> float | None:
    """A loss as a float (a tensor is read once: a device sync); None when not given.
    Detached first: torch warns when a tensor that requires grad becomes a float, and that
    warning would reach the user's terminal (rank 0's output in the view)."""
    if loss is None:
        return None
    if isinstance(loss, torch.Tensor):
        return float(loss.detach().float().item())
    return float(loss)


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every floating-point element of ``tensors`` is finite: one reduction per
    tensor, read once per device (a sharded tensor: this rank's shard)."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.is_floating_point() and local.numel():
            flags.setdefault(local.device, []).append(torch.isfinite(local.detach()).all())
    return all(bool(torch.stack(group).all()) for group in flags.values())
