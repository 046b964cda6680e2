"""scripts/benchlib.py: the spread and noise figures every benchmark reports."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import benchlib


def test_spread_is_median_min_max() -> None:
    assert benchlib.spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0,
                                                       "n": 4}


def test_ratio_spread_bounds_every_pairing() -> None:
    r = benchlib.ratio_spread([2.0, 4.0, 3.0], [1.0, 2.0, 1.5])
    assert r == {"median": 2.0, "min": 1.0, "max": 4.0}


def test_noisy_from_load_or_busy_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(benchlib.os, "cpu_count", lambda: 2)
    assert not benchlib.noisy(0.2, 1.4, 0.98)
    assert benchlib.noisy(0.2, 1.6, 0.98)  # over 0.75 per core
    assert benchlib.noisy(0.2, 0.3, 0.6)  # the busy loop found no free core
    assert not benchlib.noisy(0.2, 0.3, None)


def test_write_json_to_file(tmp_path: Path) -> None:
    benchlib.write_json(str(tmp_path / "c.json"), {"points": [1]})
    assert json.loads((tmp_path / "c.json").read_text()) == {"points": [1]}


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None,
                    reason="matplotlib installed: the missing-extra message cannot show")
def test_plot_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"elastictrain\[plot\]"):
        benchlib.plot_curve(str(tmp_path / "c.png"), "t", [1.0], {"a": []}, "MB/s")


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs [plot]")
def test_plot_writes_png(tmp_path: Path) -> None:
    point = {"median": 2.0, "min": 1.0, "max": 3.0}
    benchlib.plot_curve(str(tmp_path / "c.png"), "t", [64.0, 256.0],
                        {"a": [point, point]}, "MB/s")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
