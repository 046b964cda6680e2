"""`elastictrain goodput` on a real killed demo run: the split per cause closes to 100%
of wall time, attributes the kills, and --plot draws the timeline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_cli

pytestmark = pytest.mark.distributed


def test_split_of_a_run_with_two_kills(tmp_path: Path, two_kills_demo: dict[str, Any]) -> None:
    out = two_kills_demo
    assert out["restarts"] == 2 and out["resumed_from"] == [None, 25, 75]
    png = tmp_path / "run.png"
    result = run_cli(["goodput", out["events_dir"], "--json", f"--plot={png}"], tmp_path)
    assert result.returncode == 0, result.stderr
    split = json.loads(result.stdout)["split"]
    seconds = split["seconds"]
    assert sum(seconds.values()) == pytest.approx(split["wall_s"], abs=0.01)
    assert sum(split["fractions"].values()) == pytest.approx(1.0, abs=0.001)
    assert seconds["productive"] > 0 and seconds["restart"] > 0 and seconds["restore"] > 0
    assert seconds["snapshot_blocking"] > 0 and seconds["lost_work"] > 0
    assert split["snapshot_blocking_by_tier"].keys() == {"durable"}
    attempts = split["attempts"]
    # Kills at 40 and 80 with snapshots every 25: 15 then 5 steps redone.
    assert [(a["from_step"], a["to_step"], a["lost_steps"]) for a in attempts] == [
        (None, 40, 15), (25, 80, 5), (75, 100, 0)]
    assert attempts[-1]["ended_by"] == "finished"
    assert all(a["ended_by"] != "finished" for a in attempts[:2])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
