"""After a restore of replicated (DDP) state every rank holds the same state, or the
run stops; at the end of the run, replicas that ended apart are reported.

The restore agrees on one snapshot and verifies its bytes, but a replica rebuilt wrong
(two nodes that each loaded a copy of their own, a fault between load and apply) would
go on training on other parameters while every launcher reports success. So every rank
hashes what it now holds, the parameters and buffers, the optimizer's state and the
step, and one all-reduce compares the hashes. A mismatch raises ``ReplicasDiverged`` on
every rank before the first step. At ``close()`` the parameters are compared once more,
in the end agreement's own all-reduce (``report_end``): ranks that ended apart are
logged as ``run.replicas_diverged`` (an error; the run's end stands: its snapshots are
rank 0's). Sharded (FSDP2) state differs per rank by design: its
restore checks each shard against its manifest instead. Cost: docs/memory-tier.md.
"""

from __future__ import annotations

from typing import Any

import torch
from isal import isal_zlib

from elastictrain.core.errors import ReplicasDiverged
from elastictrain.core.log import get_logger
from elastictrain.snapshot.format.tensorbytes import tensor_bytes
from elastictrain.worker.dist import DistContext

_MASK = (1 << 32) - 1

log = get_logger("elastictrain.snapshot")


def state_digest(model_state: dict[str, Any], optimizer_state: dict[str, Any] | None,
                 step: int) -> int:
    """CRC-32 over the step, every tensor of ``model_state`` (sorted keys) and every
    tensor of the optimizer's per-parameter state, in order. Equal replicas give equal
    digests; a differing bit changes it."""
    crc = isal_zlib.crc32(str(step).encode())
    for key in sorted(model_state):
        crc = _update(isal_zlib.crc32(key.encode(), crc), model_state[key])
    if optimizer_state is not None:
        for index in sorted(optimizer_state.get("state", {})):
            entries = optimizer_state["state"][index]
            for name in sorted(entries):
                crc = _update(crc, entries[name])
    return crc & _MASK


def report_end(ctx: DistContext, digest: int, highest: int, lowest: int, step: int) -> bool:
    """(every rank) Whether the replicas ended as one (the largest and smallest digest
    of the end agreement); if not, rank 0 logs ``run.replicas_diverged``."""
    if highest == lowest:
        return True
    described = _described(ctx, digest)
    if ctx.rank == 0:
        log.error("run.replicas_diverged", final_step=step, digests=described,
                  fix="the snapshots hold rank 0's replica; find what changed one rank's "
                  "parameters (a model not wrapped in DistributedDataParallel, a parameter "
                  "changed on one rank only)")
    return False


def _described(ctx: DistContext, digest: int) -> str:
    """(every rank: a gather) Which ranks hold which digest."""
    found = ctx.all_gather_object(digest)
    groups: dict[int, list[int]] = {}
    for rank, value in enumerate(found):
        groups.setdefault(value, []).append(rank)
    return "; ".join(f"ranks {ranks}: {value:08x}" for value, ranks in groups.items())


def _update(crc: int, value: Any) -> int:
    if not isinstance(value, torch.Tensor):
        return isal_zlib.crc32(repr(value).encode(), crc)
    # reshape: a 0-d tensor (BatchNorm's num_batches_tracked, Adam's step) has no byte view
    flat = value.detach().cpu().contiguous().reshape(-1)
    return isal_zlib.crc32(tensor_bytes(flat.view(torch.uint8)) if flat.numel() else b"", crc)


def check(ctx: DistContext, digest: int, when: str) -> None:
    """(every rank) Raise ``ReplicasDiverged`` on every rank unless every rank's
    ``digest`` is this one; ``when`` says where (``after restoring step 13``)."""
    if not ctx.initialized or ctx.world_size == 1:
        return
    highest, neg_lowest = ctx.all_reduce_max([digest, -digest])
    if highest == -neg_lowest:
        return
    raise ReplicasDiverged(
        f"{when} the ranks hold different states ({_described(ctx, digest)}): "
        "training on would give each replica other weights, so the run stops here; "
        "nothing was deleted; fix: inspect the snapshot with `elastictrain snapshots "
        "verify`, then relaunch (a restore that meets this again reads durable storage "
        "after you remove the node-memory directories, docs/memory-tier.md)")
