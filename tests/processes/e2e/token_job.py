"""A language-model-shaped job on token shards (run under torchrun or ``elastictrain run``
by tests/processes/e2e/test_token_resume.py, not by pytest).

    python tests/processes/e2e/token_job.py STORAGE SHARDS_DIR STEPS --record DIR [options]

Every ``*.bin`` under SHARDS_DIR, sorted, is a TokenDataset of ``--seq-len`` tokens per
sample, dealt by an ElasticSampler that carries its fingerprint, and loaded by a
DataLoader with one worker process and a prefetch. Each rank appends the sample ids it
trained in each step to its own file under ``--record`` (the demo's record format,
elastictrain/demo/records.py), read from the tokens themselves: the test's shards hold
``position`` at every position of the token space, so a sample's first input is
``id * seq_len``. ``--kill-after N``: in the first attempt, once step N and the snapshot in
flight are committed on every rank, rank 1 SIGKILLs itself.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import elastictrain as et
from elastictrain.demo.records import SampleRecorder


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("storage")
    p.add_argument("shards", type=Path)
    p.add_argument("steps", type=int)
    p.add_argument("--record", required=True)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--dtype", default="uint16")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--kill-after", type=int, default=0)
    return p.parse_args(argv)


def main() -> None:
    args = parse(sys.argv[1:])
    rt = et.init()
    try:
        train(args, rt)
    finally:
        et.shutdown()


def train(args: argparse.Namespace, rt: et.Runtime) -> None:
    data = et.TokenDataset(sorted(str(p) for p in args.shards.glob("*.bin")), args.seq_len,
                           args.dtype)
    sampler = et.ElasticSampler(len(data), args.batch, rt.rank, rt.world_size,
                                fingerprint=data.fingerprint)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, num_workers=1,
                        prefetch_factor=2, generator=torch.Generator())
    torch.manual_seed(0)
    model = torch.nn.Linear(args.seq_len, 1)
    ddp = DistributedDataParallel(model) if rt.ctx.initialized else model
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    snap = et.SnapshotManager(args.storage, model=ddp, optimizer=opt, sampler=sampler,
                              ctx=rt.ctx, every_steps=args.every)
    snap.restore()
    recorder = SampleRecorder.open(args.record, rt)
    while snap.step_count < args.steps:
        for inputs, targets in loader:
            scale = float(len(data) * args.seq_len)
            loss = (ddp(inputs.float() / scale) - targets[:, -1:].float() / scale).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            recorder.record(snap.step_count + 1, snap.epoch,
                            (inputs[:, 0] // args.seq_len).tolist())
            opt.step()
            snap.step()
            if args.kill_after == snap.step_count and rt.env.restart_count == 0:
                die_on_rank_1(snap, rt)
            if snap.step_count >= args.steps:
                break
        else:
            snap.epoch += 1
    recorder.close()
    snap.close()


def die_on_rank_1(snap: et.SnapshotManager, rt: et.Runtime) -> None:
    """Every rank waits for the snapshot in flight, then rank 1 dies (SIGKILL)."""
    snap.wait()
    if rt.ctx.initialized:
        dist.barrier()
    if rt.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
