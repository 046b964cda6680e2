"""FSDP2 training that survives a kill and resumes, at the same or another world size.

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    torchrun --nproc-per-node 2 examples/fsdp_resumable.py /tmp/run1
    # killed? relaunch with any --nproc-per-node (1, 2, 3, ...): it resumes

Every rank holds a shard of the model and of AdamW's state; every rank writes
its own shard of each snapshot (docs/sharded.md). The global batch stays 12
samples at any world size, so the data order does not depend on it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import elastictrain as et

GLOBAL_BATCH = 12


def build_model(world_size: int) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and every world size
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 1))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("storage", help="snapshot location: a path, memory://…, s3://…")
    parser.add_argument("--steps", type=int, default=60, help="train until this step")
    parser.add_argument("--every", type=int, default=5, help="snapshot every N steps")
    parser.add_argument("--record", type=Path, default=None,
                        help="directory for a per-step JSON record (rank 0) and pid files")
    parser.add_argument("--stall-after", type=int, default=None,
                        help="stop making progress after this step and wait to be killed "
                             "(how the kill test gets a job with a known last snapshot)")
    args = parser.parse_args()

    rt = et.init()
    data = torch.randn(480, 17, generator=torch.Generator().manual_seed(1))
    model = build_model(rt.world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    sampler = et.ElasticSampler(len(data), batch_size=GLOBAL_BATCH, rank=rt.rank,
                                world_size=rt.world_size, global_batch_size=GLOBAL_BATCH)
    snap = et.SnapshotManager(args.storage, model=model, optimizer=opt, scheduler=sched,
                              sampler=sampler, ctx=rt.ctx, every_steps=args.every)
    resume = snap.restore()  # sharded: every rank reads only what its new shard needs
    if args.record is not None:
        args.record.mkdir(parents=True, exist_ok=True)
        (args.record / f"pid-rank{rt.rank}").write_text(str(os.getpid()))
    while snap.step_count < args.steps:
        if sampler.epoch_done:
            snap.epoch += 1
        plan = next(sampler.steps())
        indices = [i for micro in plan.micros for i in micro.indices]
        batch = data[indices]
        # Sum over this rank's samples / global batch x W: FSDP averages gradients over
        # the W ranks, so the update is the same at any world size.
        loss = ((model(batch[:, :16]).squeeze(1) - batch[:, 16]) ** 2).sum()
        (loss * rt.world_size / GLOBAL_BATCH).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        everyone: list[list[int]] = [indices]
        if rt.ctx.initialized:
            everyone = [[] for _ in range(rt.world_size)]
            dist.all_gather_object(everyone, indices)
        snap.step()
        if args.record is not None and rt.rank == 0:
            with open(args.record / "steps.jsonl", "a") as f:
                f.write(json.dumps({"step": snap.step_count, "world_size": rt.world_size,
                                    "samples": sorted(i for r in everyone for i in r)}) + "\n")
        if snap.step_count == args.stall_after:
            snap.wait()
            while True:  # killed here by the test
                time.sleep(1)
    snap.close()
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(param.full_tensor().detach().numpy().tobytes())  # type: ignore[attr-defined]
    if args.record is not None and rt.rank == 0:
        (args.record / "final.json").write_text(json.dumps(
            {"step": snap.step_count, "params_sha256": digest.hexdigest(),
             "resumed_from": resume.from_step, "world_size": rt.world_size}))
    et.shutdown()


if __name__ == "__main__":
    main()
