"""The demo's training worker: a small character-level GPT under DDP.

Run by torchrun (``python -m elastictrain.demo.worker``); ``elastictrain demo``
launches it. Reads like any DDP script, with the four elastictrain calls:
``init``, ``ElasticSampler``, ``SnapshotManager.restore/step``, ``close``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import elastictrain as et
from elastictrain.core.log import get_logger
from elastictrain.demo.corpus import CharDataset, IndexedPrefix, demo_corpus
from elastictrain.demo.model import CharGPT, GPTConfig
from elastictrain.demo.multinode import Park, wait_at_gates
from elastictrain.demo.records import SampleRecorder

log = get_logger("elastictrain.demo")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="elastictrain.demo.worker")
    p.add_argument("--storage", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--snapshot-every", type=snapshot_every, default=25,
                   help="steps between durable snapshots, or 'auto' (docs/interval.md)")
    p.add_argument("--memory-every", type=snapshot_every, default=None,
                   help="steps between node-memory snapshots, or 'auto' "
                   "(docs/memory-tier.md)")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--kill-at", type=int, action="append", default=[])
    p.add_argument("--hang-at", type=int, default=None,
                   help="on the first attempt, rank 1 hangs in a collective at this step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--samples", type=int, default=None, help="train on the first N windows")
    p.add_argument("--record-samples", default=None, help="dir: per-step sample indices")
    p.add_argument("--events-dir", default=None)
    p.add_argument("--park", type=Park.parse, action="append", default=[])  # set by the
    p.add_argument("--park-dir", default=None)  # multi-node runner: multinode.Park
    return p.parse_args(argv)


def snapshot_every(value: str) -> int | str:
    """``--snapshot-every`` / ``--memory-every``: a whole number of steps, or ``auto``
    (Young/Daly)."""
    if value.strip().lower() == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r}: not a number of steps; fix: a whole number >= 1 or 'auto'") from None


def kill_if_scheduled(kills: list[int], step: int, rt: et.Runtime,
                      snap: et.SnapshotManager) -> None:
    """Kill i (sorted) fires on attempt i, at its step, on rank (i + 1) % world: the
    first kill hits a non-writer, the second the writer; each fires exactly once.

    Every rank first waits for the save in flight and meets at a barrier, so the demo
    always resumes from the newest snapshot taken before the kill step: its outcome
    does not depend on how fast the background persist was. (A kill *during* a
    persist is tested on its own: tests/processes/e2e/test_async_kill.py.)
    """
    attempt = rt.env.restart_count
    if attempt >= len(kills) or kills[attempt] != step:
        return
    snap.wait()
    rt.ctx.barrier()
    if rt.rank == (attempt + 1) % rt.world_size:
        log.warning("demo.kill", signal="SIGKILL", pid=os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)


def hang_if_scheduled(hang_at: int | None, step: int, rt: et.Runtime) -> None:
    """First attempt only: every rank makes a fresh group, then rank 1 all-reduces on it
    alone (it waits for peers that never come) while rank 0 goes on into the next
    step's gradient all-reduce, which waits for rank 1: both hang inside collectives."""
    if hang_at != step or rt.env.restart_count != 0 or not rt.ctx.initialized:
        return
    import torch.distributed as torch_dist

    group = torch_dist.new_group(backend="gloo")
    if rt.rank == 1:
        log.warning("demo.hang", pid=os.getpid())
        torch_dist.all_reduce(torch.zeros(1), group=group)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # one core per worker; the other is left for background work
    rt = et.init(et.load_settings(None, **settings_overrides(args)))
    try:
        train(args, rt)
    finally:
        et.shutdown()


def settings_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the worker's options set (over the environment and config file)."""
    overrides: dict[str, Any] = {"storage": {"url": args.storage},
                 "snapshot": {"every_steps": args.snapshot_every, "keep": args.keep,
                              "progress_every_s": 1.0}}  # the live view's step rate
    if args.memory_every is not None:  # else ELASTICTRAIN_SNAPSHOT__MEMORY_EVERY still counts
        overrides["snapshot"]["memory_every"] = args.memory_every
    if args.events_dir:
        overrides["log"] = {"events_dir": args.events_dir}
    return overrides


def train(args: argparse.Namespace, rt: et.Runtime) -> None:
    vocab, windows = demo_corpus(GPTConfig(vocab_size=1).block_size)
    config = GPTConfig(vocab_size=len(vocab))
    dataset = IndexedPrefix(windows, args.samples)
    torch.manual_seed(args.seed)
    model = CharGPT(config)
    ddp = DistributedDataParallel(model) if rt.ctx.initialized else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(args.steps, 1))
    sampler = et.ElasticSampler(len(dataset), args.batch_size, rt.rank, rt.world_size,
                                seed=args.seed, global_batch_size=args.global_batch_size)
    # A private generator: iter(DataLoader) otherwise draws from the global RNG, so a
    # resume that starts iterating mid-epoch would shift every later dropout mask.
    loader = DataLoader(dataset, batch_sampler=et.MicroBatchSampler(sampler),
                        generator=torch.Generator())
    snap = et.SnapshotManager(rt.settings.storage, model=ddp, optimizer=optimizer,
                              scheduler=scheduler, sampler=sampler, ctx=rt.ctx,
                              config=rt.settings.snapshot, progress_dir=rt.events_dir)
    resumed_at = snap.restore().from_step or 0
    kills = sorted(args.kill_at)
    recorder = SampleRecorder.open(args.record_samples, rt) if args.record_samples else None
    gate = functools.partial(wait_at_gates, args.park, Path(args.park_dir or "."),
                             world_size=rt.world_size, restart_count=rt.env.restart_count,
                             rank=rt.rank)
    gate(None)
    while snap.step_count < args.steps:
        for micro_batches in et.optimizer_steps(loader):
            # Recorded before the optimizer step: the step's boundary record, which
            # lets a peer node rescue the step, leaves in it (records.py says why).
            record = (None if recorder is None else functools.partial(
                recorder.record, snap.step_count + 1, snap.epoch))
            loss = train_step(ddp, optimizer, micro_batches, record)
            scheduler.step()
            snap.step(loss=loss)
            if snap.step_count == resumed_at + 1:  # time to first step, for the summary
                log.info("demo.first_step")
            kill_if_scheduled(kills, snap.step_count, rt, snap)
            gate(snap.step_count)
            hang_if_scheduled(args.hang_at, snap.step_count, rt)
            if snap.step_count >= args.steps:
                break
        else:
            snap.epoch += 1
    if args.snapshot_every == "auto" or snap.step_count % args.snapshot_every != 0:
        snap.save()  # the final state, so a re-run resumes at the end
    if recorder is not None:
        recorder.close()
    # close() logs run.finished (final step, epoch, param digest) on rank 0; the demo
    # adds its evaluation loss to that one event.
    snap.close(**({"final_loss": eval_loss(model, windows)} if rt.rank == 0 else {}))


def train_step(ddp: torch.nn.Module, optimizer: torch.optim.Optimizer,
               micro_batches: list[tuple[et.Micro, Any]],
               record: Callable[[list[int]], None] | None = None) -> torch.Tensor:
    """One optimizer step over its micro-batches; returns the last micro-batch's loss
    (a tensor: read only when reported). ``record`` gets the sample indices trained,
    after the backward passes and before the optimizer step.

    All but the last backward run under ``no_sync`` (gradients accumulate locally;
    the last one all-reduces); each mean loss is scaled so the step's gradient is
    the mean over the whole step (see elastictrain.worker.batching).
    """
    optimizer.zero_grad(set_to_none=True)
    trained: list[int] = []
    loss = torch.zeros(())
    for micro, (index, x, y) in micro_batches:
        accumulate = isinstance(ddp, DistributedDataParallel) and not micro.last
        with ddp.no_sync() if accumulate else contextlib.nullcontext():  # type: ignore[operator]
            _, loss = ddp(x, y)
            # Scale 1 (the per-rank policy) skips the multiply: the graph stays as before.
            (loss if micro.loss_scale == 1.0 else loss * micro.loss_scale).backward()
        trained += index.tolist()
    if record is not None:
        record(trained)
    optimizer.step()
    return loss.detach()


@torch.no_grad()
def eval_loss(model: CharGPT, dataset: CharDataset, batches: int = 4,
              batch_size: int = 16) -> float:
    """Loss on a fixed set of windows in eval mode: deterministic, comparable across runs."""
    model.eval()
    total = 0.0
    for b in range(batches):
        items = [dataset[(b * batch_size + i) % len(dataset)] for i in range(batch_size)]
        x = torch.stack([it[0] for it in items])
        y = torch.stack([it[1] for it in items])
        _, loss = model(x, y)
        assert loss is not None
        total += float(loss)
    model.train()
    return round(total / batches, 6)


if __name__ == "__main__":
    main()
