"""What the replica check costs a restore (docs/memory-tier.md#every-rank-holds-one-state).

After a restore of replicated state every rank hashes what it holds
(``replica_check.state_digest``: parameters, buffers, optimizer state, step). This
times that hash against the restore it follows, in the same run: the state saved to
``/dev/shm`` with ``torch.save`` and read back with ``torch.load(weights_only=True)``
into the model and optimizer (the memory tier's restore without its checksum pass).

    python scripts/bench_replica_check.py --sizes 256 1024 --rounds 5 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from elastictrain.snapshot.state.replica_check import state_digest


def build(size_mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Linear layers + AdamW after one step: parameters are a third of the state."""
    width = 1024
    per_layer = width * width * 4 * 3  # weights, exp_avg, exp_avg_sq
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(max(1, size_mb * 2**20 // per_layer))])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    return model, opt


def timed(fn: Any, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def measure(size_mb: int, rounds: int) -> dict[str, Any]:
    model, opt = build(size_mb)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.NamedTemporaryFile(dir=directory, suffix=".pt") as f:
        torch.save(state, f.name)
        size = os.path.getsize(f.name)

        def restore() -> None:
            loaded = torch.load(f.name, weights_only=True)
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optimizer"])

        restore_s = timed(restore, rounds)
    digest_s = timed(lambda: state_digest(model.state_dict(), opt.state_dict(), 1), rounds)
    ratios = [d / r for d, r in zip(digest_s, restore_s, strict=True)]
    return {"size_mb": round(size / 2**20, 1), "digest_s": statistics.median(digest_s),
            "digest_s_range": [min(digest_s), max(digest_s)],
            "restore_s": statistics.median(restore_s),
            "restore_s_range": [min(restore_s), max(restore_s)],
            "digest_vs_restore": statistics.median(ratios),
            "digest_vs_restore_range": [min(ratios), max(ratios)],
            "digest_gb_per_s": size / 2**30 / statistics.median(digest_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256], metavar="MB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {"load_before": os.getloadavg()[0],
               "sizes": [measure(size, args.rounds) for size in args.sizes],
               "load_after": os.getloadavg()[0], "torch": torch.__version__}
    if args.json:
        print(json.dumps(results))
        return
    for r in results["sizes"]:
        print(f"{r['size_mb']:>8} MB  digest {r['digest_s']:.3f} s ({r['digest_gb_per_s']:.2f} "
              f"GB/s)  restore {r['restore_s']:.3f} s  digest/restore "
              f"{r['digest_vs_restore']:.3f} [{r['digest_vs_restore_range'][0]:.3f}-"
              f"{r['digest_vs_restore_range'][1]:.3f}]")
    print(f"load {results['load_before']:.1f} -> {results['load_after']:.1f}")


if __name__ == "__main__":
    main()
