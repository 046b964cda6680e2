"""The demo's training worker: a small character-level GPT under DDP.

Run by torchrun (``python -m elastictrain.demo.worker``); ``elastictrain demo``
launches it. Reads like any DDP script, with the four elastictrain calls:
``init``, ``ElasticSampler``, ``SnapshotManager.restore/step``, ``close``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
from collections.abc import Sequence

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import elastictrain as et
from elastictrain.demo.corpus import CharDataset, CharVocab, encode_tensor, load_corpus_text
from elastictrain.demo.model import CharGPT, GPTConfig
from elastictrain.log import get_logger
from elastictrain.snapshot.manager import unwrap

log = get_logger("elastictrain.demo")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="elastictrain.demo.worker")
    p.add_argument("--storage", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--snapshot-every", type=int, default=25)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--kill-at", type=int, action="append", default=[])
    p.add_argument("--hang-at", type=int, default=None,
                   help="on the first attempt, rank 1 hangs in a collective at this step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--events-dir", default=None)
    return p.parse_args(argv)


def param_digest(model: torch.nn.Module) -> str:
    """sha256 over the state_dict tensors' bytes in sorted key order."""
    digest = hashlib.sha256()
    state = unwrap(model).state_dict()
    for key in sorted(state):
        tensor = state[key].detach().cpu().contiguous()
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def kill_if_scheduled(kills: list[int], step: int, rt: et.Runtime) -> None:
    """Kill i (sorted) fires on attempt i, at its step, on rank (i + 1) % world: the
    first kill hits a non-writer, the second the writer; each fires exactly once."""
    attempt = rt.env.restart_count
    if attempt < len(kills) and kills[attempt] == step and rt.rank == (attempt + 1) % rt.world_size:
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
    overrides = {"storage": {"url": args.storage},
                 "snapshot": {"every_steps": args.snapshot_every, "keep": args.keep}}
    if args.events_dir:
        overrides["log"] = {"events_dir": args.events_dir}
    rt = et.init(et.load_settings(**overrides))
    try:
        train(args, rt)
    finally:
        et.shutdown()


def train(args: argparse.Namespace, rt: et.Runtime) -> None:
    text = load_corpus_text()
    vocab = CharVocab(text)
    config = GPTConfig(vocab_size=len(vocab))
    dataset = CharDataset(encode_tensor(vocab, text), config.block_size)
    torch.manual_seed(args.seed)
    model = CharGPT(config)
    ddp = DistributedDataParallel(model) if rt.ctx.initialized else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(args.steps, 1))
    sampler = et.ElasticSampler(len(dataset), args.batch_size, rt.rank, rt.world_size,
                                seed=args.seed)
    # A private generator: iter(DataLoader) otherwise draws from the global RNG, so a
    # resume that starts iterating mid-epoch would shift every later dropout mask.
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        generator=torch.Generator())
    snap = et.SnapshotManager(rt.settings.storage.url, model=ddp, optimizer=optimizer,
                              scheduler=scheduler, sampler=sampler, ctx=rt.ctx,
                              config=rt.settings.snapshot, progress_dir=rt.events_dir,
                              storage_options=rt.settings.storage.storage_options)
    snap.restore()
    kills = sorted(args.kill_at)
    while snap.step_count < args.steps:
        for x, y in loader:
            _, loss = ddp(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            snap.step()
            kill_if_scheduled(kills, snap.step_count, rt)
            hang_if_scheduled(args.hang_at, snap.step_count, rt)
            if snap.step_count >= args.steps:
                break
        else:
            snap.epoch += 1
    if snap.step_count % args.snapshot_every != 0:
        snap.save()  # the final state, so a re-run resumes at the end
    snap.close()
    if rt.rank == 0:
        log.info("run.finished", final_step=snap.step_count, final_loss=eval_loss(model, dataset),
                 param_digest=param_digest(model), epoch=snap.epoch)


@torch.no_grad()
def eval_loss(model: CharGPT, dataset: CharDataset, batches: int = 4, batch_size: int = 16) -> float:
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
