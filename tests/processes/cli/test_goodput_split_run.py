"""``elastictrain goodput --split`` as a child process: its JSON and its plot, and a storage
root standing for its newest run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_cli
from tests.unit.runlog.test_goodput_split import _ev, _write, write_synthetic_run


@pytest.mark.processes
def test_cli_json_and_plot(tmp_path: Path) -> None:
    run_dir = write_synthetic_run(tmp_path)
    pytest.importorskip("matplotlib")
    png = tmp_path / "cli.png"
    result = run_cli(["goodput", str(run_dir), "--json", "--plot", str(png)], tmp_path)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["split"]["wall_s"] == pytest.approx(37.0)
    # One goodput figure: the top level is the split's, over the same wall.
    assert out["wall_s"] == out["split"]["wall_s"]
    assert out["goodput"] == out["split"]["fractions"]["productive"]
    assert out["steps_lost"] == sum(a["lost_steps"] for a in out["split"]["attempts"]) == 9
    assert png.stat().st_size > 0
    bad = run_cli(["goodput", str(run_dir), "--plot", str(tmp_path / "no" / "x.png")],
                  tmp_path)
    assert bad.returncode != 0 and "fix: pass a path in a writable directory" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.processes
def test_a_storage_root_stands_for_its_newest_run(tmp_path: Path) -> None:
    from elastictrain.runlog.goodput import run_events_location

    root = tmp_path / "ckpt"
    (root / "snapshots").mkdir(parents=True)
    for run, launch in (("old", "20240101T000000Z-aaaa"), ("new", "20250101T000000Z-bbbb")):
        (root / "events" / run).mkdir(parents=True)
        _write(root / "events" / run / f"attempt000-{launch}-rank0.jsonl",
               _ev("worker.start", 1.0), _ev("resume", 2.0, from_step=None),
               _ev("run.finished", 3.0, 5))
    assert run_events_location(str(root)) == f"{root}/events/new"
    assert run_events_location(str(root / "events" / "old")) == str(root / "events" / "old")
    result = run_cli(["goodput", str(root), "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["events_dir"] == f"{root}/events/new" and out["final_step"] == 5
    assert out["split"]["attempts"][0]["ended_by"] == "finished"


