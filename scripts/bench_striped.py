"""Striped writes of replicated (DDP) state vs rank 0 alone, on local disk and moto S3.

    python scripts/bench_striped.py [--size-mb 48] [--rounds 3] [--dir /tmp] [--json]

Two ranks (gloo, ``torch.multiprocessing``) hold the same DDP model + AdamW state
of about ``--size-mb``. "rank0" is the replicated path (rank 0 serialises and writes
everything); "striped" is ``SnapshotManager(..., sharded=True)``: DCP writes each
replicated tensor once, on the rank with the fewest planned bytes, and rank 0
commits one manifest. Per round and method: ``save()`` on both ranks at the same
step, then wait until durable (persist time = save() to durable on rank 0, median
of ``--rounds``), and the bytes each rank wrote (from the manifest). moto runs as a
child process on 127.0.0.1 (``scripts/bench_s3.py``'s server); keep S3 states ≤ 50 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_s3 import free_port, moto_server  # noqa: E402

from elastictrain.snapshot.manager import SnapshotManager  # noqa: E402
from elastictrain.storage import open_store  # noqa: E402
from elastictrain.worker.dist import DistContext  # noqa: E402

WIDTH = 1024


def rank_main(rank: int, port: int, layers: int, url: str, options: dict[str, Any],
              rounds: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ctx = DistContext(rank, 2, rank, "gloo", torch.device("cpu"), True)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, WIDTH)).sum().backward()
    opt.step()
    result: dict[str, Any] = {}
    for method in ("rank0", "striped"):
        snap = SnapshotManager(f"{url}/{method}", model=model, optimizer=opt, ctx=ctx, keep=1,
                               sharded=method == "striped", storage_options=options)
        times = []
        for _ in range(rounds + 1):  # the first round allocates buffers: not counted
            snap.step_count += 1
            dist.barrier()
            started = time.perf_counter()
            handle = snap.save()
            snap.wait()
            times.append(time.perf_counter() - started)
            dist.barrier()
            if rank == 0 and handle.manifest is not None:
                by_rank: dict[int, int] = {}
                for o in handle.manifest.objects:
                    by_rank[o.rank or 0] = by_rank.get(o.rank or 0, 0) + o.size_bytes
                result[f"{method}_bytes_by_rank"] = [by_rank.get(r, 0) for r in (0, 1)]
        snap.close()
        result[f"{method}_persist_s"] = statistics.median(times[1:])
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def measure(url: str, options: dict[str, Any], layers: int, rounds: int,
            work: Path) -> dict[str, Any]:
    out = work / "result.json"
    torch_mp.start_processes(rank_main, nprocs=2, start_method="spawn",
                             args=(free_port(), layers, url, options, rounds, str(out)))
    return dict(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=48, help="model + AdamW state")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    layers = max(2, round(args.size_mb * 2**20 / (WIDTH * WIDTH * 4 * 3)))
    work = Path(tempfile.mkdtemp(prefix="bench-striped-", dir=args.dir))
    results: dict[str, Any] = {"setup": {"ranks": 2, "layers": layers, "width": WIDTH,
                                         "rounds": args.rounds}}
    try:
        results["local"] = measure(str(work / "store"), {}, layers, args.rounds, work)
        with moto_server() as endpoint:
            options = {"key": "bench", "secret": "bench",
                       "client_kwargs": {"endpoint_url": endpoint}}
            open_store("s3://bench-striped", options).fs.mkdir("bench-striped")
            results["moto"] = measure("s3://bench-striped/run", options, layers, args.rounds,
                                      work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(results))
        return
    print(f"2 ranks, DDP {layers} x Linear({WIDTH}, {WIDTH}) + AdamW; persist = save() to "
          f"durable, median of {args.rounds}")
    print(f"{'where':>6} {'method':>8} {'persist_s':>9} {'rank0_MB':>9} {'rank1_MB':>9}")
    for where in ("local", "moto"):
        r = results[where]
        for method in ("rank0", "striped"):
            b = r[f"{method}_bytes_by_rank"]
            print(f"{where:>6} {method:>8} {r[f'{method}_persist_s']:>9.2f} "
                  f"{b[0] / 1e6:>9.1f} {b[1] / 1e6:>9.1f}")


if __name__ == "__main__":
    main()
