"""Memory and time of sharded snapshots: what a save and a restore add per rank.

    python scripts/bench_sharded.py [--shard-mb 256] [--ranks 2] [--dir /tmp] [--json]

Setup: ``--ranks`` processes (gloo, ``torch.multiprocessing``), an MLP of bias-free
Linear 2048x2048 layers built on the meta device and sharded with ``fully_shard``
(no rank ever holds the full model), AdamW state materialised by one step: the
model + optimizer state per rank is about ``--shard-mb``. Each rank samples its own
resident set (``/proc/self/statm``) every 2 ms in a thread; "added" is the peak
during the operation minus the resident set just before it (the live training
state is already there; free heap is handed back to the OS first, ``malloc_trim``,
so an operation cannot hide its allocations in memory freed earlier). Measured per rank:

* async save (first: allocates the reusable staging buffers; second: reuses them),
  from ``save()`` to durable;
* sync save (``mode="sync"``: no staging copy, the live tensors are written);
* restore into the live model and optimizer (DCP reads item by item).

Each of the three runs in fresh processes, so no memory freed by one is there to be
reused by the next.

The bound checked is the issue's: added memory ≤ shard x 1.3 + 64 MiB.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchlib import free_port  # noqa: E402  (scripts/, beside this file)

from elastictrain.snapshot.manager import SnapshotManager  # noqa: E402
from elastictrain.worker.dist import DistContext  # noqa: E402

WIDTH = 2048
BUFFER_MB = 64
_PAGE = os.sysconf("SC_PAGE_SIZE")


def release_free_memory() -> None:
    """Give freed heap back to the OS (glibc ``malloc_trim``), so that the baseline
    does not hold free memory an operation could reuse without being counted."""
    ctypes.CDLL(None).malloc_trim(0)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRss:
    """The highest resident set seen while the block runs (sampled every 2 ms)."""

    def __enter__(self) -> PeakRss:
        release_free_memory()
        self.before = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def added(self) -> int:
        return self.peak - self.before


def build(layers: int, world: int) -> tuple[nn.Module, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, WIDTH ** -0.5)  # on the local shard only
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, WIDTH)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def rank_main(rank: int, world: int, port: int, layers: int, root: str, out: str,
              phase: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ctx = DistContext(rank, world, rank, "gloo", torch.device("cpu"), True)
    model, opt = build(layers, world)
    local = [p.to_local() for p in model.parameters()]  # type: ignore[attr-defined]
    shard = sum(t.numel() * t.element_size() for t in local) * 3  # params + 2 AdamW moments
    row: dict[str, Any] = {"rank": rank, "shard_mb": shard / 2**20,
                           "rss_before_mb": rss_bytes() / 2**20}
    if phase in ("async", "sync"):
        _saves(ctx, model, opt, root, row, phase)
    else:
        again = SnapshotManager(f"{root}/sync", model=model, optimizer=opt, ctx=ctx,
                                mode="sync")
        dist.barrier()
        started = time.perf_counter()
        with PeakRss() as peak:
            info = again.restore()
        assert info.from_step == 1, info
        row["restore"] = {"added_mb": peak.added / 2**20, "s": time.perf_counter() - started}
        again.close()
    Path(out, f"{phase}-rank{rank}.json").write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def _saves(ctx: DistContext, model: nn.Module, opt: Any, root: str, row: dict[str, Any],
           mode: str) -> None:
    snap = SnapshotManager(f"{root}/{mode}", model=model, optimizer=opt, ctx=ctx, mode=mode,
                           keep=1)
    for attempt in (1, 2) if mode == "async" else (1,):
        snap.step_count += 1
        dist.barrier()
        started = time.perf_counter()
        with PeakRss() as peak:
            handle = snap.save()
            blocked = time.perf_counter() - started
            handle.wait()
        durable = time.perf_counter() - started
        key = f"save_{mode}{attempt if mode == 'async' else ''}"
        row[key] = {"added_mb": peak.added / 2**20, "blocking_s": blocked,
                    "durable_s": durable}
    snap.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard-mb", type=float, default=256,
                        help="model + AdamW state per rank (MiB)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where snapshots go")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    layer_mb = WIDTH * WIDTH * 4 * 3 / 2**20 / args.ranks  # per rank, with AdamW
    layers = max(1, round(args.shard_mb / layer_mb))
    work = Path(tempfile.mkdtemp(prefix="bench-sharded-", dir=args.dir))
    try:
        for phase in ("async", "sync", "restore"):
            torch_mp.start_processes(rank_main, nprocs=args.ranks, start_method="spawn",
                                     args=(args.ranks, free_port(), layers,
                                           str(work / "store"), str(work), phase))
        rows = []
        for r in range(args.ranks):
            row = json.loads((work / f"async-rank{r}.json").read_text())
            row["save_sync"] = json.loads((work / f"sync-rank{r}.json").read_text())["save_sync"]
            row["restore"] = json.loads((work / f"restore-rank{r}.json").read_text())["restore"]
            rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    bound = {r["rank"]: r["shard_mb"] * 1.3 + BUFFER_MB for r in rows}
    result = {
        "setup": {"ranks": args.ranks, "layers": layers, "width": WIDTH,
                  "bound": f"added <= shard x 1.3 + {BUFFER_MB} MiB", "dir": args.dir},
        "ranks": rows,
        "within_bound": all(r[k]["added_mb"] <= bound[r["rank"]]
                            for r in rows
                            for k in ("save_async1", "save_async2", "save_sync", "restore")),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.ranks} ranks, {layers} x Linear({WIDTH}, {WIDTH}) + AdamW, "
          f"memory added during the operation (MiB) and time (s)")
    print(f"{'rank':>4} {'shard':>7} {'rss':>6} {'async#1':>8} {'async#2':>8} {'sync':>7} "
          f"{'restore':>8} {'bound':>7}  {'durable#2':>9} {'blocking#2':>10} {'restore_s':>9}")
    for r in rows:
        print(f"{r['rank']:>4} {r['shard_mb']:>7.0f} {r['rss_before_mb']:>6.0f} "
              f"{r['save_async1']['added_mb']:>8.0f} "
              f"{r['save_async2']['added_mb']:>8.0f} {r['save_sync']['added_mb']:>7.0f} "
              f"{r['restore']['added_mb']:>8.0f} {bound[r['rank']]:>7.0f}  "
              f"{r['save_async2']['durable_s']:>9.2f} {r['save_async2']['blocking_s']:>10.2f} "
              f"{r['restore']['s']:>9.2f}")
    print("every operation within the bound:", result["within_bound"])


if __name__ == "__main__":
    main()
