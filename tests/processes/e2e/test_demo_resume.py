"""End to end under real torchrun: SIGKILL a worker, restart all, resume, finish.

Every run here is the real `elastictrain demo` CLI: a torchrun agent with
--max-restarts, gloo workers, real SIGKILLs, local storage in tmp_path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from elastictrain.core import layout
from tests.helpers import events, run_cli, run_demo_json

pytestmark = pytest.mark.distributed


def test_kill_resumes_from_last_committed_step(tmp_path: Path,
                                              one_kill_demo: dict[str, Any]) -> None:
    out = one_kill_demo
    assert out["restarts"] == 1
    assert out["resumed_from"] == [None, 30]  # the last commit before the kill at 34
    assert out["lost_steps"] == 4
    assert out["final_step"] == 60
    assert 30 in out["committed_steps"] and 60 in out["committed_steps"]
    kills = events(Path(out["events_dir"]), "demo.kill")
    assert len(kills) == 1 and kills[0]["restart_count"] == 0 and kills[0]["step"] == 34
    # The operator's view of the same run: `elastictrain goodput` on its event log.
    report = run_cli(["goodput", out["events_dir"], "--json"], tmp_path)
    assert report.returncode == 0, report.stderr
    goodput = json.loads(report.stdout)
    assert (goodput["attempts"], goodput["final_step"], goodput["steps_lost"]) == (2, 60, 4)
    assert 0 < goodput["goodput"] < 1 and goodput["restart_s"] > 0
    # One goodput figure: the top level is the per-cause split's measured time.
    assert goodput["goodput"] == goodput["split"]["fractions"]["productive"]
    assert goodput["lost_work_s"] == goodput["split"]["seconds"]["lost_work"] > 0


def test_kills_do_not_change_the_result(tmp_path: Path, two_kills_demo: dict[str, Any]
                                        ) -> None:
    """Two kills (one of the writer), across an epoch boundary (~73 steps/epoch),
    give bit-identical parameters to an uninterrupted run."""
    clean = run_demo_json(tmp_path, f"--storage={tmp_path / 'a'}", "--steps=100", "--seed=3")
    killed = two_kills_demo
    assert killed["restarts"] == 2 and killed["resumed_from"] == [None, 25, 75]
    assert killed["param_digest"] == clean["param_digest"]
    assert killed["final_loss"] == clean["final_loss"]


def test_six_restarts_in_a_row_all_rejoin(tmp_path: Path) -> None:
    """The gloo store trap shows on restarts after the first: six kills, six clean
    rejoins."""
    kills = [3 + 5 * i for i in range(6)]  # 3, 8, …, 28; snapshots every 5 steps
    out = run_demo_json(tmp_path, f"--storage={tmp_path / 's'}", "--steps=32",
                        "--snapshot-every=5", *[f"--kill-at={k}" for k in kills], timeout=420)
    assert out["restarts"] == 6
    assert out["resumed_from"] == [None, None] + [5 * i for i in range(1, 6)]
    assert out["final_step"] == 32
    joined = events(Path(out["events_dir"]), "rendezvous.joined")
    assert len(joined) == 2 * 7  # both ranks, every attempt


def test_autoresume_and_corrupt_newest_falls_back(tmp_path: Path) -> None:
    storage = tmp_path / "s"
    first = run_demo_json(tmp_path, f"--storage={storage}", "--steps=50", "--snapshot-every=25")
    assert first["committed_steps"] == [25, 50]
    payload = storage / layout.step_dir(50) / layout.PAYLOAD
    payload.write_bytes(payload.read_bytes()[:1000])  # truncate the newest payload
    second = run_demo_json(tmp_path, f"--storage={storage}", "--steps=60", "--snapshot-every=25")
    assert second["resumed_from"] == [25]
    assert second["final_step"] == 60
    corrupt = events(Path(second["events_dir"]), "snapshot.corrupt")
    assert corrupt and corrupt[0]["snapshot_step"] == 50
    # Autoresume: the same command again trains nothing more and keeps the result.
    third = run_demo_json(tmp_path, f"--storage={storage}", "--steps=60", "--snapshot-every=25")
    assert third["resumed_from"] == [60] and third["param_digest"] == second["param_digest"]


@pytest.mark.parametrize("args,needle", [
    (["--steps=50", "--kill-at=80"], "--kill-at=80"),
    (["--snapshot-every=0"], "--snapshot-every=0"),
])
def test_bad_demo_input_is_one_clear_line(tmp_path: Path, args: list[str], needle: str) -> None:
    result = run_cli(["demo", f"--storage={tmp_path / 's'}", *args], tmp_path)
    assert result.returncode == 2
    assert (needle in result.stderr and "fix" in result.stderr) or "must be" in result.stderr
    assert not (tmp_path / "s").exists()  # nothing started, nothing written


def test_unwritable_storage_fails_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = run_cli(["demo", f"--storage={blocker / 'run'}"], tmp_path)
    assert result.returncode != 0
    assert str(blocker) in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_json_output_is_one_object(tmp_path: Path) -> None:
    result = run_cli(["demo", "--json", f"--storage={tmp_path / 's'}", "--steps=5",
                      "--snapshot-every=5", "--nproc=1"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    assert set(out) >= {"final_step", "restarts", "resumed_from", "committed_steps",
                        "lost_steps", "final_loss", "param_digest"}
