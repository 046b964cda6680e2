"""A GPT-style pretraining loop on elastictrain.

What a real language-model run does, small enough for a laptop: token shards read by
``TokenDataset`` through ``DataLoader`` workers, a global batch fixed at any world size
(gradient accumulation over micro-batches, DDP's ``no_sync`` on all but the last),
bf16 autocast or fp16 with a ``GradScaler``, ``torch.compile``, a learning rate computed
from the step (warm-up, then cosine), and an evaluation every ``--eval-every`` steps that
keeps ``best_val_loss`` and saves when it improves. Lines that are elastictrain's are
marked ``# et:``.

Make some tokens, then run it::

    python -c "import numpy as np; np.random.default_rng(0).integers(0, 512, 400_000,
        dtype=np.uint16).tofile('tokens.bin')"
    elastictrain run --nproc-per-node 2 examples/llm_pretrain.py ./ckpt --data tokens.bin
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 \\
        examples/llm_pretrain.py ./ckpt --data tokens.bin --compile --precision bf16

A kill resumes bit-identical at the same world size; a relaunch at another world size
trains every remaining sample exactly once (docs/guide.md#converting-your-own-loop),
and with ``--virtual-shards V`` ends on the same bits as a run never resized
(docs/elastic-resume.md#the-same-bits-across-a-resize).
``--record-samples DIR`` writes the sample ids each rank trained per step (the demo's
format): how the tests check that.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset

import elastictrain as et
from elastictrain.demo.records import SampleRecorder


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, width: int, layers: int, heads: int,
                 dropout: float) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(seq_len, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(width, heads, dropout) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as GPT-2's
        for embedding in (self.tokens, self.positions):
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tokens(idx) + self.positions(positions))
        logits = self.head(self.norm(self.blocks(x)))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Warm-up, then cosine down to a tenth: a function of the step alone, so a resumed
    run needs no scheduler state."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def autocast(args: argparse.Namespace) -> contextlib.AbstractContextManager[None]:
    if args.precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float16
    return torch.autocast(args.device, dtype=dtype)


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
             args: argparse.Namespace) -> float:
    """The mean validation loss over every rank (the same value on each)."""
    model.eval()
    total, count = torch.zeros(2), 0
    for inputs, targets in batches:
        with autocast(args):
            total[0] += model(inputs, targets).float()
        count += 1
    total[1] = count
    if dist.is_initialized():
        dist.all_reduce(total)
    model.train()
    return float(total[0]) / max(float(total[1]), 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("storage", help="where snapshots go: a path or a URL")
    parser.add_argument("--data", nargs="+", required=True, help="token shard files")
    parser.add_argument("--dtype", default="uint16", choices=["uint16", "uint32"])
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--val-samples", type=int, default=32)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile's backend (aot_eager: no code generation)")
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers")
    parser.add_argument("--record-samples", metavar="DIR")
    parser.add_argument("--virtual-shards", type=int, default=None, metavar="V",
                        help="the same bits at any world size (at a cost)")
    args = parser.parse_args()

    rt = et.init()  # et: logging and the process group from the launcher's environment
    args.device = "cpu"  # on GPUs: f"cuda:{rt.local_rank}", and torch.cuda.set_device
    tokens = et.TokenDataset(args.data, seq_len=args.seq_len, dtype=args.dtype)  # et
    val = Subset(tokens, range(args.val_samples))  # the first samples: held out
    train = Subset(tokens, range(args.val_samples, len(tokens)))
    # et: a global order that does not depend on the world size, and a global batch
    # of --global-batch samples at any world size, in micro-batches of --micro-batch.
    sampler = et.ElasticSampler(len(train), batch_size=args.micro_batch, rank=rt.rank,
                                world_size=rt.world_size, global_batch_size=args.global_batch,
                                fingerprint=tokens.fingerprint,
                                virtual_shards=args.virtual_shards)
    loader = DataLoader(train, batch_sampler=et.MicroBatchSampler(sampler),  # et
                        num_workers=args.workers, generator=torch.Generator())
    val_loader = DataLoader(Subset(val, range(rt.rank, len(val), rt.world_size)),
                            batch_size=args.micro_batch)

    torch.manual_seed(0)
    model = GPT(args.vocab, args.seq_len, args.width, args.layers, args.heads, args.dropout)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    scaler = torch.amp.GradScaler(args.device, enabled=args.precision == "fp16")
    if args.compile:
        model = torch.compile(model, backend=args.compile_backend)  # type: ignore[assignment]
    ddp = DDP(model)
    # et: model, optimizer, scaler, data position, epoch, every rank's RNG and extras.
    snap = et.SnapshotManager(args.storage, model=ddp, optimizer=optimizer, scaler=scaler,
                              sampler=sampler, ctx=rt.ctx, every_steps=args.save_every)
    snap.extras.setdefault("best_val_loss", float("inf"))
    snap.restore()  # et: the newest verified snapshot, or a fresh start
    shards = et.ShardSum(ddp) if args.virtual_shards else None  # et: sums in shard order
    recorder = (SampleRecorder.open(args.record_samples, rt) if args.record_samples
                else None)

    while snap.step_count < args.steps:
        for micro_batches in et.optimizer_steps(loader):  # et: one item per optimizer step
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(snap.step_count, args)
            for micro, (inputs, targets) in micro_batches:
                if shards is not None:  # et: one shard: its own backward, kept apart
                    with shards.shard(micro):
                        with autocast(args):
                            loss = ddp(inputs.long(), targets.long()) * micro.loss_scale
                        scaler.scale(loss).backward()
                    continue
                sync = contextlib.nullcontext() if micro.last else ddp.no_sync()
                with sync, autocast(args):
                    loss = ddp(inputs.long(), targets.long()) * micro.loss_scale  # et
                scaler.scale(loss).backward()
            if shards is not None:
                shards.reduce()  # et: every rank, every step
            if recorder is not None:
                recorder.record(snap.step_count + 1, snap.epoch,
                                [i for micro, _ in micro_batches for i in micro.indices])
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            snap.step()  # et: a snapshot every --save-every steps
            if snap.step_count % args.eval_every == 0:
                val_loss = evaluate(model, iter(val_loader), args)
                if rt.rank == 0:
                    print(f"step {snap.step_count} | val loss {val_loss:.4f} | "
                          f"world size {rt.world_size}", flush=True)
                if val_loss < snap.extras["best_val_loss"]:  # the same on every rank
                    snap.extras["best_val_loss"] = val_loss
                    snap.save()  # et: every rank, at the same step
            if snap.step_count >= args.steps:
                break
        else:
            snap.epoch += 1  # the data ran out: the next epoch
    if recorder is not None:
        recorder.close()
    snap.close()  # et: waits for the last save; saves the last step if needed
    et.shutdown()


if __name__ == "__main__":
    main()
