"""DDP's gradient buckets as the uninterrupted run had them, from the first step after a
restore.

DDP reduces gradients bucket by bucket, and an all-reduce sums each element over the
ranks in an order that depends on where the element sits in its bucket. A fresh DDP
model packs every parameter into one bucket for its first step, then rebuilds the
buckets in the order the gradients became ready. A restarted process would therefore
reduce its first step in another layout than the process that was never stopped, and
above two ranks floating-point addition rounds differently. The rebuilt layout is
recorded with every snapshot; a restore gives the fresh DDP model that layout before its
first step, the way DDP itself rebuilds its reducer after unpickling
(``DistributedDataParallel.__setstate__``). The reducer then rebuilds after that step as
usual, into the same layout. docs/scale.md#bit-exact-resume-above-two-ranks.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

log = structlog.get_logger("elastictrain.dist")

Layout = list[list[int]]  # parameter indices per bucket, in the reducer's bucket order


def find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The DDP wrapper of ``model``, also under ``torch.compile``; None when not DDP."""
    while not isinstance(model, DistributedDataParallel):
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return None
        model = inner
    return model


def rebuilt_layout(ddp: DistributedDataParallel) -> Layout | None:
    """The layout DDP rebuilt after its first step in this process; None before that.

    DDP publishes it in its logging data, refreshed at the forward passes it samples
    (every one of the first ten): up to its third step the refresh is asked for here."""
    text = _logged_layout(ddp)
    if text is None:
        try:
            ddp.logger.set_runtime_stats_and_log()  # type: ignore[union-attr]
        except Exception:  # a logger that cannot refresh: the layout stays unknown
            return None
        text = _logged_layout(ddp)
    return parse(text) if text is not None else None


def _logged_layout(ddp: DistributedDataParallel) -> str | None:
    data = ddp._get_ddp_logging_data()
    text = data.get("rebuilt_per_bucket_param_indices")
    return text if data.get("has_rebuilt_buckets") and isinstance(text, str) else None


def parse(text: str) -> Layout:
    """DDP's text form ("7 6 5 4, 3 2 1 0": buckets by commas) as lists of indices."""
    return [[int(i) for i in bucket.split()] for bucket in text.split(",") if bucket.strip()]


def why_not_installable(ddp: DistributedDataParallel, layout: Any) -> str | None:
    """None when ``layout`` can replace the fresh reducer's; else why not (in words)."""
    if not _rebuild_known(ddp):
        return (f"torch {torch.__version__}'s DDP does not rebuild its reducer the way "
                "elastictrain knows (torch 2.10 to 2.13 do)")
    if getattr(ddp, "_comm_hooks", None):
        return "the model has a comm hook (DDP's reducer would be rebuilt without it)"
    if getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "_delay_all_reduce_all_params",
                                                             False):
        return "the model's gradients are not reduced by DDP's own reducer"
    parameters, _ = ddp._build_params_for_reducer()
    if not (isinstance(layout, list) and all(isinstance(b, list) and b for b in layout)):
        return "the recorded layout is not a list of buckets"
    flat = [i for bucket in layout for i in bucket]
    if sorted(flat) != list(range(len(parameters))) or not all(type(i) is int for i in flat):
        return (f"the recorded layout covers {len(flat)} parameters, the model has "
                f"{len(parameters)}")
    for bucket in layout:
        kinds = {(parameters[i].dtype, parameters[i].device) for i in bucket}
        if len(kinds) > 1:
            return "a recorded bucket mixes dtypes or devices"
    return None


def _rebuild_known(ddp: DistributedDataParallel) -> bool:
    """Whether ``ddp`` has the helpers DDP's own unpickling rebuilds its reducer with,
    taking the arguments :func:`install` passes."""
    helper = getattr(ddp, "_ddp_init_helper", None)
    if not (callable(helper) and callable(getattr(ddp, "_build_params_for_reducer", None))
            and callable(getattr(ddp, "_build_debug_param_to_name_mapping", None))
            and callable(getattr(dist, "_compute_bucket_assignment_by_size", None))):
        return False
    return list(inspect.signature(helper).parameters) == [
        "parameters", "expect_sparse_gradient", "param_to_name_mapping", "static_graph"]


def install(ddp: DistributedDataParallel, layout: Layout) -> None:
    """Rebuild ``ddp``'s reducer with ``layout`` as its buckets (checked first with
    :func:`why_not_installable`). Only before the model's first backward pass."""
    parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
    names = ddp._build_debug_param_to_name_mapping(parameters)
    cap = int(ddp.bucket_bytes_cap)
    with _bucket_assignment(layout, cap):
        ddp._ddp_init_helper(parameters, expect_sparse_gradient, names, ddp.static_graph)
    if ddp.static_graph:  # as DDP's own rebuild of its reducer does (__setstate__)
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()  # type: ignore[union-attr]


@contextmanager
def _bucket_assignment(layout: Layout, cap: int) -> Iterator[None]:
    """DDP's bucket assignment answers ``layout`` while its reducer is built (DDP reverses
    the assignment it is given: the layout goes in reversed)."""
    original = dist._compute_bucket_assignment_by_size

    def assigned(*_args: Any, **_kwargs: Any) -> tuple[Layout, list[int]]:
        return [list(b) for b in reversed(layout)], [cap] * len(layout)

    dist._compute_bucket_assignment_by_size = assigned
    try:
        yield
    finally:
        dist._compute_bucket_assignment_by_size = original


class BucketLayout:
    """The layout a snapshot records and a restore gives back, for one model."""

    def __init__(self, model: nn.Module) -> None:
        self._ddp = find_ddp(model)
        self._installed: Layout | None = None
        self._rebuilt: Layout | None = None  # kept once known: DDP rebuilds only once
        # DDP rebuilds after its first synchronised step; one that never synchronises
        # (every backward under no_sync, as with virtual shards) never does: stop asking.
        self._asks_left = 3

    def observe(self) -> None:
        """Read DDP's rebuilt layout once it exists; called after each step on the loop's
        thread (the read takes the reducer's lock, which a save on another thread, the
        rescue's, must never wait for)."""
        if self._ddp is not None and self._rebuilt is None and self._asks_left > 0:
            self._asks_left -= 1
            self._rebuilt = rebuilt_layout(self._ddp)

    def for_snapshot(self) -> Layout | None:
        """The layout in use: DDP's rebuilt one, else the one a restore installed (the
        reducer has not rebuilt yet); None when not DDP or not known yet."""
        return self._rebuilt or self._installed

    def restore(self, saved: Any) -> None:
        """Give the fresh DDP model the layout ``saved`` with a snapshot; said in the
        ``dist.bucket_layout`` event. No collective agrees on it: every rank reads the
        same snapshot and checks it against the same model, so all install it or none."""
        if self._ddp is None or saved is None:
            return
        reason = why_not_installable(self._ddp, saved)
        if reason is None:
            install(self._ddp, saved)
            self._installed = saved
        log.info("dist.bucket_layout", installed=reason is None, buckets=len(saved),
                 reason=reason)

