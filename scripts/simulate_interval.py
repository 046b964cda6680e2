"""Simulate the automatic snapshot interval against fixed intervals on failure traces.

A run needs ``work`` seconds of training. Every interval it pays ``cost`` seconds
of blocking for a snapshot; a failure loses everything since the last completed
snapshot and costs ``recovery`` seconds before training resumes. The "auto"
policy is elastictrain's own ``IntervalPolicy``: a new one per attempt, fed the
failure history of the earlier attempts and the cost it measures, exactly as the
manager does. The fixed intervals are a geometric grid; the best one is chosen in
hindsight on the same traces. Wasted time = wall time - work.

    python scripts/simulate_interval.py                     # the full table
    python scripts/simulate_interval.py --mtbf 120 --dist exponential --json

Defaults are measured on the demo: snapshot blocking 0.02 s (``snapshot.staged``),
kill -> first resumed step 4.0 s (``scripts/bench_recovery.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import asdict, dataclass

from elastictrain.core import log
from elastictrain.snapshot.schedule.interval import FailureHistory, IntervalPolicy


@dataclass(frozen=True)
class Row:
    dist: str
    mtbf_s: float
    failures: float
    auto_waste_s: float
    best_fixed_s: float
    best_fixed_waste_s: float
    young_daly_true_s: float
    ratio: float


def failure_gaps(dist: str, mtbf: float, count: int, rng: random.Random, shape: float
                 ) -> list[float]:
    """Times between failures with mean ``mtbf``: exponential, or Weibull of ``shape``."""
    if dist == "exponential":
        return [rng.expovariate(1.0 / mtbf) for _ in range(count)]
    scale = mtbf / math.gamma(1.0 + 1.0 / shape)
    return [rng.weibullvariate(scale, shape) for _ in range(count)]


def waste_fixed(gaps: list[float], interval: float, cost: float, recovery: float,
                work: float) -> float:
    """Wasted seconds with a fixed interval (closed form per failure gap)."""
    done, wall = 0.0, 0.0
    for gap in gaps:
        remaining = work - done
        needed = math.ceil(remaining / interval)
        if remaining + needed * cost <= gap:
            return wall + remaining + needed * cost - work
        segments = int(gap // (interval + cost))
        done += segments * interval
        wall += gap + recovery
    return math.inf  # the trace ran out before the work was done


def waste_auto(gaps: list[float], cost: float, recovery: float, work: float,
               prior: float, min_s: float, max_s: float) -> tuple[float, int]:
    """Wasted seconds and failures with the manager's IntervalPolicy, one per attempt."""
    done, wall, uptime = 0.0, 0.0, 0.0
    for failures, gap in enumerate(gaps):
        clock = _Clock()
        policy = IntervalPolicy(prior, min_s, max_s, FailureHistory(uptime, failures), clock)
        saved = done
        while True:
            interval = min(policy.evaluate(), work - saved)
            if clock.now + interval + cost > gap:
                break
            clock.now += interval + cost
            saved += interval
            policy.observe_cost(cost)
            if saved >= work:
                return wall + clock.now - work, failures
        done = saved
        wall += gap + recovery
        uptime += gap
    return math.inf, len(gaps)


class _Clock:
    """Simulated seconds since the attempt started."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(dist: str, mtbf: float, args: argparse.Namespace) -> Row:
    grid = [args.min_interval * (args.max_interval / args.min_interval) ** (i / 79)
            for i in range(80)]
    auto, fixed = 0.0, [0.0] * len(grid)
    failures = 0
    for seed in range(args.seed, args.seed + args.trials):
        gaps = failure_gaps(dist, mtbf, args.failures * 4, random.Random(seed), args.shape)
        work = args.failures * mtbf  # about `failures` failures per run
        wasted, failed = waste_auto(gaps, args.cost, args.recovery, work, args.prior,
                                    args.min_interval, args.max_interval)
        auto += wasted
        failures += failed
        for i, interval in enumerate(grid):
            fixed[i] += waste_fixed(gaps, interval, args.cost, args.recovery, work)
    best = min(range(len(grid)), key=lambda i: fixed[i])
    n = args.trials
    return Row(dist=dist, mtbf_s=mtbf, failures=round(failures / n, 1),
               auto_waste_s=round(auto / n, 2), best_fixed_s=round(grid[best], 3),
               best_fixed_waste_s=round(fixed[best] / n, 2),
               young_daly_true_s=round(math.sqrt(2 * args.cost * mtbf), 3),
               ratio=round(auto / fixed[best], 4))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cost", type=float, default=0.02, help="snapshot blocking C, s")
    parser.add_argument("--recovery", type=float, default=4.0, help="recovery time R, s")
    parser.add_argument("--mtbf", type=float, nargs="+", default=[120, 300, 600, 1800, 3600])
    parser.add_argument("--dist", nargs="+", choices=["exponential", "weibull"],
                        default=["exponential", "weibull"])
    parser.add_argument("--shape", type=float, default=0.7, help="Weibull shape (<1: bursty)")
    parser.add_argument("--failures", type=int, default=100, help="failures per run, about")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prior", type=float, default=3600.0, help="auto's MTBF prior, s")
    parser.add_argument("--min-interval", type=float, default=1.0)
    parser.add_argument("--max-interval", type=float, default=3600.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    for name in ("cost", "recovery", "shape", "prior", "min_interval", "max_interval"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be > 0")
    if args.failures < 1 or args.trials < 1:
        parser.error("--failures and --trials must be >= 1")
    log.configure(level="warning")  # the policy's snapshot.interval events are noise here
    rows = [simulate(dist, mtbf, args) for dist in args.dist for mtbf in args.mtbf]
    if args.json:
        print(json.dumps({"cost_s": args.cost, "recovery_s": args.recovery,
                          "rows": [asdict(r) for r in rows],
                          "worst_ratio": max(r.ratio for r in rows)}))
        return 0
    print(f"C={args.cost}s R={args.recovery}s prior={args.prior}s, wasted seconds per run "
          f"(mean of {args.trials}), auto vs the best fixed interval in hindsight")
    print(f"{'dist':<12}{'MTBF s':>8}{'fails':>7}{'auto':>11}{'best fixed':>12}"
          f"{'at s':>9}{'YD(true)':>10}{'auto/best':>11}")
    for r in rows:
        print(f"{r.dist:<12}{r.mtbf_s:>8.0f}{r.failures:>7.1f}{r.auto_waste_s:>11.1f}"
              f"{r.best_fixed_waste_s:>12.1f}{r.best_fixed_s:>9.2f}{r.young_daly_true_s:>10.2f}"
              f"{r.ratio:>11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
