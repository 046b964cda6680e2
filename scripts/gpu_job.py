"""The training job of ``scripts/gpu_checks.py``: a user's DDP or FSDP2 loop on CUDA
(NCCL) when a GPU is there, on CPU (gloo) in the checks' dry mode. Run under
``elastictrain run``; never imported.

    python scripts/gpu_job.py ROOT --steps N [--fsdp] [--kill-at S] [--stall-at S]
                              [--notice-at S] [--nan-at S] [--width W] [--layers L]

In the first attempt only: ``--kill-at`` SIGKILLs this worker after step S (once
the last snapshot is durable),
``--stall-at`` launches a CUDA kernel that spins for an hour after step S and waits
for it (on CPU: sleeps), ``--notice-at`` sends this worker SIGTERM (a preemption
notice) right after the save of step S returned, while it persists, ``--nan-at`` fills
one parameter with NaN just before the save of step S (a fault before a save: the
snapshot's bytes verify, its sense does not). The loss goes to ``step(loss=…)`` so a
restore is checked for sense. At the end rank 0
writes ``ROOT/result.json``: the digest of the full parameters, the steps, the backend,
whether CUDA was initialised before ``elastictrain.init()`` (a standby that forked the
worker after touching CUDA would break it) and the attempt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch

import elastictrain as et


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--stall-at", type=int, default=None)
    parser.add_argument("--notice-at", type=int, default=None)
    parser.add_argument("--nan-at", type=int, default=None)
    return parser.parse_args()


def full_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's full value in name order (DTensors gathered)."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        value = param.detach()
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        digest.update(name.encode())
        digest.update(value.float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def stall(device: torch.device) -> None:
    """A kernel that never returns in time: what a hung collective or a bad kernel
    looks like to the loop (the watchdog must fire)."""
    if device.type == "cuda":
        torch.cuda._sleep(2**62)  # spins on the GPU (cycles), far past any timeout
        torch.cuda.synchronize()
    else:
        time.sleep(3600)


def main() -> None:
    args = parse()
    cuda_before_init = torch.cuda.is_initialized()
    rt = et.init()
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    torch.manual_seed(0)
    device = rt.device
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model: torch.nn.Module = torch.nn.Sequential(*layers).to(device)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.children():
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        wrapped = model
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    snap = et.SnapshotManager(args.root, model=wrapped, optimizer=opt, ctx=rt.ctx,
                              every_steps=args.every)
    info = snap.restore()
    while snap.step_count < args.steps:
        # The batch depends on the step and rank only: a resume is exact or it is not.
        gen = torch.Generator().manual_seed(snap.step_count * 1000 + rt.rank)
        x = torch.randn(32, args.width, generator=gen).to(device)
        loss = wrapped(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if first_attempt and snap.step_count + 1 == args.nan_at:
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))
        handle = snap.step(loss=loss)
        step = snap.step_count
        if first_attempt and step == args.kill_at:
            snap.wait()  # the last snapshot committed: the resume step is known
            os.kill(os.getpid(), signal.SIGKILL)
        if first_attempt and step == args.stall_at:
            stall(device)
        if first_attempt and step == args.notice_at and rt.rank == 0:
            in_flight = handle is not None and not handle.done()
            Path(args.root, "notice.json").write_text(json.dumps({"in_flight": in_flight}))
            os.kill(os.getpid(), signal.SIGTERM)
    digest = full_digest(model)
    snap.close()
    if rt.rank == 0:
        Path(args.root, "result.json").write_text(json.dumps({
            "digest": digest, "final_step": snap.step_count, "resumed_from": info.from_step,
            "backend": rt.ctx.backend, "device": str(device), "world_size": rt.world_size,
            "cuda_initialized_before_init": cuda_before_init,
            "suspects": sorted(p.name for p in Path(args.root).glob("suspect/*")),
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}))
    et.shutdown()


if __name__ == "__main__":
    main()
