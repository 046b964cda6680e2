"""A step's gradient summed over virtual shards in shard order: the same bits at any
world size.

With ``ElasticSampler(global_batch_size=G, virtual_shards=V)`` every optimizer step is
cut into ``V`` shards that do not depend on the world size ``W``, and rank ``r`` trains
shards ``r, r + W, …`` one micro-batch at a time. :class:`ShardSum` keeps each shard's
gradient apart (the backward runs under DDP's ``no_sync``, DDP reduces nothing), then
:meth:`ShardSum.reduce` sums them element by element in shard order ``0, 1, …, V - 1``
on whichever rank owns that element (an all-to-all of each shard's segments), and
gathers the sums back into every parameter's ``.grad`` (an all-gather). A shard's
gradient is the same wherever it is computed (the same weights, samples, loss scale and
random numbers), and an element's sum runs in the same order, so the step's gradient,
and the run, are the same bits at 4, 3 or 2 ranks. Cost and limits:
docs/elastic-resume.md#the-same-bits-across-a-resize.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from elastictrain.core.errors import ConfigError
from elastictrain.worker.bucket_layout import find_ddp
from elastictrain.worker.data import Micro, shard_place, shards_of
from elastictrain.worker.exact_reduce import all_gather_tensor


class ShardSum:
    """The fixed-order sum of one step's shard gradients, for ``model`` (DDP or plain).

    Use::

        shards = ShardSum(model)
        for step in optimizer_steps(loader):
            for micro, batch in step:
                with shards.shard(micro):
                    (loss_fn(model(batch)) * micro.loss_scale).backward()
            shards.reduce()      # every rank, also one that holds no shard this step
            optimizer.step()

    Args:
        model: the model the loop calls (a ``DistributedDataParallel`` is kept from
            reducing; a sharded model is refused).
        group: the process group (default: the default group, or none when
            ``torch.distributed`` is not initialised: one rank).
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        self._ddp = find_ddp(model)
        inner = self._ddp.module if self._ddp is not None else model
        self._params = [p for p in inner.parameters() if p.requires_grad]
        if not self._params:
            raise ConfigError("ShardSum: the model has no parameter that requires a gradient")
        kinds = {(p.dtype, p.device) for p in self._params}
        if len(kinds) > 1 or any(hasattr(p, "full_tensor") for p in self._params):
            raise ConfigError(
                "ShardSum sums one replicated model whose parameters share one dtype and "
                f"device; this one has {sorted(str(k) for k in kinds)} or sharded (DTensor) "
                "parameters; fix: train it without virtual shards")
        self._group = group
        self._numel = sum(p.numel() for p in self._params)
        # This step's shards' gradients, [this rank's shard][W x segment] (a segment per
        # rank, the last one padded): each shard's backward accumulates straight into
        # its row, the parameters' .grad being views of it; None between steps.
        self._send: torch.Tensor | None = None
        self._held: dict[int, int] = {}  # row of _send → the shard (v) it holds

    @contextmanager
    def shard(self, micro: Micro) -> Iterator[None]:
        """The backward of one shard: starts from no gradient, runs under DDP's
        ``no_sync``, draws its random numbers from the shard's own seed (the loop's
        streams are left as they were), and keeps the shard's gradient apart."""
        if micro.shard is None or micro.seed is None:
            raise ConfigError("ShardSum needs the micro-batches of an ElasticSampler made "
                              "with virtual_shards=…; fix: pass virtual_shards")
        if micro.shard in self._held.values():
            raise ConfigError(f"ShardSum: shard {micro.shard}'s backward ran twice in one step")
        if self._send is None:
            world = self._world()
            first = self._params[0]
            self._send = torch.zeros(micro.count, world * -(-self._numel // world),
                                     dtype=first.dtype, device=first.device)
        # The backward adds into zeros (0 + g, the same on any rank: exact across W).
        self._point_grads_at(self._send[micro.index])
        devices = [self._params[0].device] if self._params[0].is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(micro.seed)
            with self._ddp.no_sync() if self._ddp is not None else nullcontext():
                yield
        self._keep_grads_in(self._send[micro.index])
        self._held[micro.index] = micro.shard

    def _world(self) -> int:
        return dist.get_world_size(self._group) if dist.is_initialized() else 1

    def _slices(self, flat: torch.Tensor) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """Each parameter with its part of a flat gradient (parameter order)."""
        offset = 0
        for p in self._params:
            yield p, flat[offset:offset + p.numel()]
            offset += p.numel()

    def _point_grads_at(self, row: torch.Tensor) -> None:
        for p, part in self._slices(row):
            p.grad = part.view_as(p)

    def _keep_grads_in(self, row: torch.Tensor) -> None:
        """Make sure the shard's gradient is in ``row``: autograd accumulates into an
        existing ``.grad`` in place, but a backward with ``create_graph=True`` (or a
        script that sets ``.grad``) replaces it; then it is copied in."""
        for p, part in self._slices(row):
            if p.grad is not None and p.grad.data_ptr() != part.data_ptr():
                part.copy_(p.grad.reshape(-1))
            p.grad = None

    def reduce(self) -> None:
        """Every parameter's ``.grad`` = the sum of all shards' gradients in shard order,
        the same on every rank. Called once per step on every rank."""
        send, held = self._send, self._held
        self._send, self._held = None, {}
        first = self._params[0]
        world = self._world()
        if send is None:  # this rank holds no shard in this step
            send = torch.zeros(0, world * -(-self._numel // world), dtype=first.dtype,
                               device=first.device)
        if len(held) != send.shape[0]:
            raise ConfigError(f"ShardSum: {send.shape[0]} shards were this rank's in the "
                              f"step, {len(held)} ran their backward")
        if world == 1:
            total = _ordered_sum([send[row] for row in _order(held)])
        else:
            total = self._exchange(send, held, world)
        self._point_grads_at(total)  # views of one buffer, as DDP's gradient_as_bucket_view

    def _exchange(self, send: torch.Tensor, held: dict[int, int], world: int) -> torch.Tensor:
        """The ordered sum over all ranks' shards: each rank sums the segment of elements
        it owns, then the segments are gathered."""
        first = self._params[0]
        rank = dist.get_rank(self._group)
        count = torch.tensor([len(held)], dtype=torch.int64, device=first.device)
        counts_t = torch.zeros(world, dtype=torch.int64, device=first.device)
        all_gather_tensor(counts_t, count, self._group).wait()
        counts = [int(c) for c in counts_t.tolist()]
        expected = shards_of(rank, sum(counts), world)  # as the sampler deals them
        if sorted(held.values()) != expected:
            raise ConfigError(f"ShardSum: rank {rank} holds shards {sorted(held.values())}, not "
                              f"{expected}: the sampler's world differs from the process "
                              "group's")
        segment = send.shape[1] // world
        order = _order(held)
        if order != list(range(len(order))):  # the loop ran its shards out of order
            send = send[order]
        # Laid out for the all-to-all: [owner of the segment][shard][segment].
        send = send.view(len(held), world, segment).transpose(0, 1).reshape(-1, segment)
        received = torch.empty(sum(counts), segment, dtype=first.dtype, device=first.device)
        dist.all_to_all_single(received, send, output_split_sizes=counts,
                               input_split_sizes=[len(held)] * world, group=self._group)
        starts = [sum(counts[:q]) for q in range(world)]
        rows = [received[starts[owner] + at]
                for owner, at in (shard_place(v, world) for v in range(sum(counts)))]
        mine = _ordered_sum(rows)
        gathered = torch.empty(world * segment, dtype=first.dtype, device=first.device)
        all_gather_tensor(gathered, mine, self._group).wait()
        return gathered[:self._numel]


def _order(held: dict[int, int]) -> list[int]:
    """The rows of ``held``'s shards, sorted by shard."""
    return sorted(held, key=lambda row: held[row])


def _ordered_sum(pieces: list[torch.Tensor]) -> torch.Tensor:
    """``((p0 + p1) + p2) + …``, element by element."""
    total = pieces[0].clone()
    for piece in pieces[1:]:
        total.add_(piece)
    return total
