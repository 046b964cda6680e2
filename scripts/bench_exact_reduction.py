"""The cost of ``dist.fixed_order_reduction`` (elastictrain/worker/exact_reduce.py): DDP's
step time with its gradient sums in rank order against DDP's own all-reduce, in the
same run, at several world sizes (gloo on this machine's CPUs; NCCL where a GPU is).

    python scripts/bench_exact_reduction.py [--ranks 2 4 8] [--params-m 4 25] \
        [--steps 20] [--rounds 3] [--json FILE]

Each round runs both variants in fresh processes, alternating which goes first; the
report gives the median step time of each, their ratio (fixed order / DDP's own) with
its spread over the rounds, and the machine's load average beside each figure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(params_m: float) -> torch.nn.Module:
    width = 1024
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _worker(rank: int, world: int, port: int, params_m: float, steps: int, fixed: bool,
            out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.nn.parallel import DistributedDataParallel

    from elastictrain.worker.exact_reduce import use_fixed_order_reduction

    torch.manual_seed(0)
    model = DistributedDataParallel(_model(params_m))
    if fixed:
        assert use_fixed_order_reduction(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 1024)
    times = []
    for step in range(steps + 3):  # 3 warm-up steps: the buckets are rebuilt after the 1st
        start = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if step >= 3:
            times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps({"step_s": statistics.median(times)}))
    dist.destroy_process_group()


def _run(world: int, params_m: float, steps: int, fixed: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.json")
        mp.spawn(_worker, args=(world, _free_port(), params_m, steps, fixed, out),
                 nprocs=world, join=True)
        return float(json.loads(Path(out).read_text())["step_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--params-m", type=float, nargs="+", default=[4.0, 25.0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for params_m in args.params_m:
        for world in args.ranks:
            own, fixed, ratios, loads = [], [], [], []
            for round_index in range(args.rounds):
                order = (False, True) if round_index % 2 == 0 else (True, False)
                got = {variant: _run(world, params_m, args.steps, variant) for variant in order}
                own.append(got[False])
                fixed.append(got[True])
                ratios.append(got[True] / got[False])
                loads.append(os.getloadavg()[0])
            row = {"params_m": params_m, "ranks": world,
                   "ddp_step_s": round(statistics.median(own), 4),
                   "fixed_order_step_s": round(statistics.median(fixed), 4),
                   "ratio_median": round(statistics.median(ratios), 3),
                   "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
                   "load_avg_1m": round(statistics.median(loads), 2)}
            rows.append(row)
            print(f"{params_m:5.0f}M params {world} ranks: DDP {row['ddp_step_s']:.4f} s, "
                  f"fixed order {row['fixed_order_step_s']:.4f} s, ratio "
                  f"{row['ratio_median']:.2f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f}), "
                  f"load {row['load_avg_1m']}", flush=True)
    report = {"torch": torch.__version__, "cpus": os.cpu_count(), "backend": "gloo",
              "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
