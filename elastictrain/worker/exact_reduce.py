"""DDP's gradient reduction in a fixed order: every element summed over the ranks in rank
order, wherever it sits in its bucket.

DDP reduces gradients bucket by bucket with an all-reduce whose summation order for an
element depends on where the element sits in its bucket (a ring splits the bucket into
one segment per rank and starts each segment's sum at another rank). DDP packs the
buckets in one way for the first step of a process and rebuilds them in gradient-ready
order after it, so the first step after a restart sums some gradients in another order
than the run that was never stopped, and at more than two ranks floating-point addition
then rounds differently: the resumed run's weights drift from the uninterrupted run's in
the last bits.

This hook makes the order independent of the packing: each rank sends every other rank
the segment of its bucket that rank owns (``all_to_all_single``), each rank adds the
pieces it received in rank order 0, 1, …, W-1, and the sums are gathered back
(``all_gather_into_tensor``). That moves as many bytes as a ring all-reduce
(2(W-1)/W of the bucket per rank) in two collectives, and it does not overlap the
backward pass the way DDP's own asynchronous all-reduce does; docs/scale.md has its
cost.
The sum is then divided by the world size, as DDP's own hook averages.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as
# objects (``bucket: dist.GradBucket``, returning ``torch.futures.Future[torch.Tensor]``).
from typing import Any

import torch
import torch.distributed as dist

# The attribute a DDP model carries once the hook is registered (DDP allows one hook).
MARK = "_elastictrain_exact_reduction"


def fixed_order_allreduce(group: Any, bucket: dist.GradBucket
                          ) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook (``ddp.register_comm_hook(group, fixed_order_allreduce)``): the
    bucket averaged over the ranks, each element summed in rank order. Both collectives
    run when the bucket is ready: a second collective issued from the first one's
    completion callback waits forever on gloo (seen here)."""
    flat = bucket.buffer()
    world = dist.get_world_size(group)
    count = flat.numel()
    segment = -(-count // world)  # ceil: rank r owns [r * segment, (r + 1) * segment)
    padded = torch.zeros(segment * world, dtype=flat.dtype, device=flat.device)
    padded[:count].copy_(flat)
    received = torch.empty_like(padded)
    dist.all_to_all_single(received, padded, group=group)
    pieces = received.view(world, segment)
    total = pieces[0].clone()
    for rank in range(1, world):
        total.add_(pieces[rank])
    total.div_(world)
    gathered = torch.empty_like(padded)
    all_gather_tensor(gathered, total, group).wait()
    flat.copy_(gathered[:count])
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(flat)
    return done


def all_gather_tensor(output: torch.Tensor, piece: torch.Tensor, group: Any) -> Any:
    """Every rank's ``piece`` into ``output``, asynchronously (``all_gather_single`` where
    torch has it: its older name warns from torch 2.13 on)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, piece, group=group, async_op=True)


def use_fixed_order_reduction(model: torch.nn.Module, group: Any = None) -> bool:
    """Register :func:`fixed_order_allreduce` on a DDP ``model`` that has no comm hook
    yet; True when the model's reduction is exact afterwards (registered now or before,
    or not needed: two ranks or fewer), False when it is not DDP or carries a hook of
    its own (left alone)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return False
    if dist.get_world_size(model.process_group) <= 2:
        # A sum of two terms does not depend on its order: DDP's own all-reduce is
        # exact already, and faster.
        return True
    if getattr(model, MARK, False):
        return True
    try:
        model.register_comm_hook(group, fixed_order_allreduce)
    except RuntimeError:  # the script registered its own hook (DDP takes one): keep it
        return False
    setattr(model, MARK, True)
    return True
