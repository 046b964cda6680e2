"""CUDA smoke check: snapshots of a CUDA model + AdamW (1 GiB of parameters, 3 GiB of
state) staged through host memory, a verified restore into a fresh CUDA model, and a
synchronous ``torch.save`` / ``torch.load`` of the same state in the same run. Prints
JSON. Needs a GPU (CI has none): run by hand on a machine with one; figures in
docs/benchmarks.md.

    python scripts/smoke_cuda.py
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from elastictrain.dist import DistContext
from elastictrain.snapshot.manager import SnapshotManager


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(4)]).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(64, 8192, device="cuda")).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def manager(root: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> SnapshotManager:
    ctx = DistContext(0, 1, 0, "gloo", torch.device("cuda", 0), False)
    return SnapshotManager(root, model=model, optimizer=opt, ctx=ctx, every_steps=10**9,
                           keep=2, mode="async")


def main() -> None:
    out: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    root = tempfile.mkdtemp()
    model, opt = build(0)
    train_step(model, opt)
    out["state_mb"] = sum(p.numel() * 4 * 3 for p in model.parameters()) / 2**20
    snap = manager(os.path.join(root, "et"), model, opt)
    snap.step()  # as a loop would: the staging buffers are prepared in the background
    returned, durable = [], []
    for _ in range(4):
        train_step(model, opt)
        snap.step_count += 1
        started = time.perf_counter()
        handle = snap.save()
        returned.append(time.perf_counter() - started)
        train_step(model, opt)  # the next step runs while the copy and persist proceed
        handle.wait()
        durable.append(time.perf_counter() - started)
    train_step(model, opt)
    snap.step_count += 1
    snap.save().wait()  # the newest snapshot: what restore must bring back
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    snap.close()
    out.update(et_first_save_return_s=returned[0], et_save_return_s=statistics.median(returned[1:]),
               et_durable_s=statistics.median(durable[1:]))
    synchronous = []
    for i in range(3):
        started = time.perf_counter()
        with open(os.path.join(root, f"ts{i}.pt"), "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        synchronous.append(time.perf_counter() - started)
    out["torch_save_sync_s"] = statistics.median(synchronous)
    fresh, fresh_opt = build(1)
    train_step(fresh, fresh_opt)
    snap = manager(os.path.join(root, "et"), fresh, fresh_opt)
    started = time.perf_counter()
    info = snap.restore()
    torch.cuda.synchronize()
    out["et_restore_s"] = time.perf_counter() - started
    out["restored_step"] = info.from_step
    out["params_equal"] = all(torch.equal(expected[k], v.detach().cpu())
                              for k, v in fresh.state_dict().items())
    out["params_on_cuda"] = all(p.is_cuda for p in fresh.parameters())
    train_step(fresh, fresh_opt)
    snap.close()
    started = time.perf_counter()
    torch.load(os.path.join(root, "ts0.pt"), map_location="cuda", weights_only=True)
    torch.cuda.synchronize()
    out["torch_load_s"] = time.perf_counter() - started
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
