"""The cost of virtual shards (``ElasticSampler(virtual_shards=V)`` + ``ShardSum``,
elastictrain/worker/shard_sum.py) against plain DDP training the same global batch, in the
same run, at several world sizes (gloo on this machine's CPUs).

    python scripts/bench_shard_sum.py [--ranks 2 3 4 8] [--global-batch 48] \
        [--shards 24] [--width 1024] [--layers 4] [--steps 10] [--rounds 3] [--json FILE]
    python scripts/bench_shard_sum.py --table FILE    # the docs' table of a saved report

Plain DDP: each rank trains its share of the global batch in one micro-batch and DDP
all-reduces the gradients. Virtual shards: each rank trains its shards one by one under
``no_sync``, then ``ShardSum.reduce`` sums them in shard order (an all-to-all of every
shard's segments and an all-gather of the sums). Each round runs both variants in
fresh processes, alternating which goes first; the report gives the median step time of
each, their ratio (shards / DDP) with its spread over the rounds, the bytes each rank
sends per step (from the collectives' sizes; DDP's as a ring all-reduce sends them), and
the machine's load average beside each figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # elastictrain from this checkout, installed or not
from benchlib import load_average, spread  # noqa: E402  (scripts/, beside this file)


def _worker(rank: int, world: int, init: str, cfg: dict[str, Any], sharded: bool,
            out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from elastictrain.worker.data import ElasticSampler
    from elastictrain.worker.shard_sum import ShardSum

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    width, batch = cfg["width"], cfg["global_batch"]
    net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(cfg["layers"])])
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    data = torch.randn(batch * (cfg["steps"] + 4), width)
    micro = batch // cfg["shards"] if sharded else -(-batch // world)
    sampler = ElasticSampler(len(data), micro, rank, world, global_batch_size=batch,
                             virtual_shards=cfg["shards"] if sharded else None)
    shards = ShardSum(model) if sharded else None
    times = []
    for i, plan in enumerate(sampler.steps()):
        if i == cfg["steps"] + 3:
            break
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for m in plan.micros:
            x = data[list(m.indices)]
            if shards is not None:
                with shards.shard(m):
                    (model(x).square().mean() * m.loss_scale).backward()
            else:
                (model(x).square().mean() * m.loss_scale).backward()
        if shards is not None:
            shards.reduce()
        opt.step()
        if i >= 3:  # 3 warm-up steps (DDP rebuilds its buckets after the first)
            times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps({"step_s": statistics.median(times)}))
    dist.destroy_process_group()


def _run(world: int, cfg: dict[str, Any], sharded: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.json")
        # Forked: the workers start without importing torch again (CPU and gloo only).
        mp.start_processes(_worker, args=(world, f"file://{tmp}/group", cfg, sharded, out),
                           nprocs=world, join=True, start_method="fork")
        return float(json.loads(Path(out).read_text())["step_s"])


def sent_bytes(params: int, world: int, shards: int, element: int = 4) -> dict[str, int]:
    """Bytes one rank sends per step: DDP's ring all-reduce, and the shards' all-to-all
    plus all-gather (the most shards a rank holds: ceil(shards / world))."""
    segment = -(-params // world)
    held = -(-shards // world)
    return {"ddp": 2 * (world - 1) * segment * element,
            "shards": (held * (world - 1) * segment + (world - 1) * segment) * element}


DASH = "\u2013"  # the pages' range dash


def _mb(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def table(report: dict[str, Any]) -> str:
    """docs/elastic-resume.md's table of a saved report."""
    lines = [f"| ranks | plain DDP, s/step | virtual shards, s/step | ratio (min{DASH}max) | "
             "sent per rank, DDP / shards | load (1 min) |", "|---|---|---|---|---|---|"]
    for row in report["rows"]:
        lines.append(f"| {row['ranks']} | {row['ddp_step_s']:.3f} | {row['shards_step_s']:.3f} "
                     f"| {row['ratio_median']:.2f} ({row['ratio_min']:.2f}{DASH}"
                     f"{row['ratio_max']:.2f}) | {_mb(row['ddp_sent_mb'])} / "
                     f"{_mb(row['shards_sent_mb'])} MB | {row['load_avg_1m']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4, 8])
    parser.add_argument("--global-batch", type=int, default=48)
    parser.add_argument("--shards", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--table", metavar="JSON", help="print the table of a saved report")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0
    cfg = {"global_batch": args.global_batch, "shards": args.shards, "width": args.width,
           "layers": args.layers, "steps": args.steps}
    params = args.layers * (args.width * args.width + args.width)
    rows: list[dict[str, Any]] = []
    for world in args.ranks:
        plain, sharded, ratios, loads = [], [], [], []
        for round_index in range(args.rounds):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            got = {variant: _run(world, cfg, variant) for variant in order}
            plain.append(got[False])
            sharded.append(got[True])
            ratios.append(got[True] / got[False])
            loads.append(load_average())
        sent, ratio = sent_bytes(params, world, args.shards), spread(ratios)  # paired
        row = {"ranks": world, "ddp_step_s": round(statistics.median(plain), 4),
               "shards_step_s": round(statistics.median(sharded), 4),
               "ratio_median": round(ratio["median"], 3),
               "ratio_min": round(ratio["min"], 3), "ratio_max": round(ratio["max"], 3),
               "ddp_sent_mb": round(sent["ddp"] / 2**20, 1),
               "shards_sent_mb": round(sent["shards"] / 2**20, 1),
               "load_avg_1m": round(statistics.median(loads), 2)}
        rows.append(row)
        print(f"{world} ranks: DDP {row['ddp_step_s']:.4f} s, shards {row['shards_step_s']:.4f}"
              f" s, ratio {row['ratio_median']:.2f} ({row['ratio_min']:.2f}-"
              f"{row['ratio_max']:.2f}); sent per rank {row['ddp_sent_mb']} vs "
              f"{row['shards_sent_mb']} MB; load {row['load_avg_1m']}", flush=True)
    report = {"torch": torch.__version__, "cpus": os.cpu_count(), "backend": "gloo",
              "params": params, "global_batch": args.global_batch, "shards": args.shards,
              "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
