"""scripts/bench_goodput.py's pure parts: the configurations it understands, the seeded
failure schedule every configuration shares, and the bound."""

from __future__ import annotations

import math
import sys

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import bench_goodput


def test_configs_map_to_demo_worker_options() -> None:
    assert bench_goodput.parse_config("fixed:40").worker_args == ["--snapshot-every=40"]
    assert bench_goodput.parse_config("auto").worker_args == ["--snapshot-every=auto"]
    assert bench_goodput.parse_config("auto+memory:1").worker_args == [
        "--snapshot-every=auto", "--memory-every=1"]
    assert bench_goodput.parse_config("auto+memory:auto").worker_args == [
        "--snapshot-every=auto", "--memory-every=auto"]
    assert bench_goodput.parse_config("fixed:10").fixed
    assert not bench_goodput.parse_config("fixed:10+memory:2").fixed


@pytest.mark.parametrize("bad", ["fixed", "fixed:0", "auto:3", "memory:1", "auto+fixed:3",
                                 "every:10"])
def test_bad_config_names_value_and_fix(bad: str) -> None:
    with pytest.raises(SystemExit) as info:
        bench_goodput.parse_config(bad)
    assert f"--configs {bad!r}: expected fixed:N or auto" in str(info.value)
    assert "fix: e.g. fixed:40 auto auto+memory:auto" in str(info.value)


def test_schedule_is_seeded_exponential_within_the_wall() -> None:
    one = bench_goodput.failure_schedule(7, 60.0, 100_000.0, 2)
    assert one == bench_goodput.failure_schedule(7, 60.0, 100_000.0, 2)  # every config
    assert one != bench_goodput.failure_schedule(8, 60.0, 100_000.0, 2)
    times = [k.at_s for k in one]
    assert times == sorted(times) and times[-1] < 100_000.0
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(60.0, rel=0.1)  # ~1700 draws
    assert {k.rank for k in one} == {0, 1}


def test_bound_is_young_daly() -> None:
    assert bench_goodput.bound(0.03, 6.0, 60.0) == pytest.approx(
        1 - math.sqrt(0.06 / 60) - 0.1)
    assert bench_goodput.bound(0.03, 0.0, math.inf) == 1.0  # no failure: no loss
    assert bench_goodput.bound(None, 6.0, 60.0) is None


def _row(config: str, productive: float, lost: float, kills: int, goodput_seed: float) -> dict:
    wall = productive + lost
    return {"config": config, "worker_args": [], "goodput": goodput_seed, "wall_s": wall,
            "seconds": {"productive": productive, "lost_work": lost}, "kills": kills,
            "recoveries": [{"recovery_s": 0.5, "lost_steps": 3, "tier": "durable"}] * kills,
            "cost": {"mean_s": 0.01, "snapshots": 10}, "noisy": False,
            "fractions": {"productive": goodput_seed}, "bound": 0.95}


def test_several_seeds_pool_their_seconds_and_keep_each_seeds_ratio() -> None:
    runs = [{"seed": 0, "results": [_row("fixed:10", 90, 10, 2, 0.9),
                                     _row("auto", 95, 5, 2, 0.95)]},
            {"seed": 1, "results": [_row("fixed:10", 80, 20, 1, 0.8),
                                     _row("auto", 70, 30, 1, 0.7)]}]
    for run in runs:
        bench_goodput.compare(run["results"])
    fixed, auto = bench_goodput.pool(runs)
    assert fixed["goodput"] == pytest.approx(170 / 200)
    assert auto["goodput"] == pytest.approx(165 / 200)
    assert auto["kills"] == 3 and auto["ratio_to_best_fixed"] == pytest.approx(165 / 170)
    assert auto["per_seed"]["ratio_to_best_fixed"] == pytest.approx([0.95 / 0.9, 0.7 / 0.8])
    assert auto["bound"] == pytest.approx(bench_goodput.bound(0.01, 0.5, 200 / 3))
    assert "[0.875-1.056]" in bench_goodput.table([fixed, auto])
