"""Resume at another world size under real torchrun, with sample accounting.

A job is run with --nproc 2, stopped at its --steps, relaunched on the same
storage with --nproc 1 (with a SIGKILL inside), and again with --nproc 3. All
three launches fall inside one epoch of 97 samples; every rank records the
samples of every step, and the steps that survive into the final run must have
trained each sample exactly once (plus the documented tail padding).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.accounting import assert_each_sample_once, surviving_steps
from tests.helpers import events, run_cli, run_demo_json

pytestmark = pytest.mark.distributed

N = 97  # samples: 97 is prime, so every world size leaves an uneven epoch tail


def demo(tmp_path: Path, *args: str) -> dict[str, object]:
    return run_demo_json(tmp_path, f"--storage={tmp_path / 's'}", f"--samples={N}",
                         "--batch-size=4", "--snapshot-every=3",
                         f"--record-samples={tmp_path / 'rec'}",
                         f"--events-dir={tmp_path / 'ev'}", *args)


def resume_of(out: dict[str, object]) -> dict[str, object]:
    """Rank 0's ``resume`` event of a finished demo's last attempt (the launches of one
    storage share a run directory: the newest by time)."""
    resumes = [e for e in events(Path(str(out["events_dir"])), "resume") if e["rank"] == 0]
    return max(resumes, key=lambda e: e["ts"])


@pytest.mark.timeout(600)  # three launches
def test_relaunch_at_other_sizes_trains_each_sample_once(tmp_path: Path) -> None:
    # Per-rank batch 4: 8 samples per step on 2 ranks, 4 on 1, 12 on 3.
    first = demo(tmp_path, "--nproc=2", "--steps=6")  # cursor 48
    assert first["resumed_from"] == [None] and first["world_sizes"] == [2]
    shrunk = demo(tmp_path, "--nproc=1", "--steps=12", "--kill-at=10")
    assert shrunk["resumed_from"] == [6, 9] and shrunk["world_sizes"] == [1, 1]
    assert shrunk["lost_steps"] == 1  # the kill after step 10 lost it; resumed from 9
    grown = demo(tmp_path, "--nproc=3", "--steps=16")
    assert grown["resumed_from"] == [12] and grown["world_sizes"] == [3]
    assert grown["final_step"] == 16
    event = resume_of(grown)
    assert (event["saved_world_size"], event["world_size"], event["rng"]) == (1, 3, "reseeded")
    assert (event["saved_global_batch"], event["global_batch"]) == (4, 12)
    assert event["global_batch_changed"] is True and event["cursor"] == 72

    steps = surviving_steps(tmp_path / "rec")
    # Step 10 ran twice (killed after it, redone from snapshot 9): the redo survives.
    assert len({e["world"] for e in events(tmp_path / "rec") if e["step"] == 10}) == 2
    assert steps[10].world == steps[11].world != steps[9].world
    assert [steps[s].world_size for s in (6, 7, 12, 13)] == [2, 1, 1, 3]
    pads = assert_each_sample_once(steps, N, seed=0, final_step=16)
    # Epoch 0: 48 + 24 at sizes 2 and 1, then 25 at size 3: two steps of 12 and a
    # tail of 1 padded to 3 with the epoch's first 2 samples.
    assert pads == {0: 2}
    assert [len(steps[s].samples) for s in (13, 14, 15)] == [12, 12, 3]
    assert steps[16].epoch == 1


@pytest.mark.timeout(480)  # two launches
def test_global_batch_is_kept_across_sizes_with_uneven_shares(tmp_path: Path) -> None:
    """--global-batch-size 10 with micro-batch 4: on 2 ranks shares 5 in micro-batches
    3 + 2; on 3 ranks shares 4, 3, 3 in one micro-batch. Every step trains 10."""
    first = demo(tmp_path, "--nproc=2", "--steps=4", "--global-batch-size=10")
    resumed = demo(tmp_path, "--nproc=3", "--steps=12", "--global-batch-size=10")
    assert first["world_sizes"] == [2] and resumed["world_sizes"] == [3]
    assert resumed["resumed_from"] == [4]
    event = resume_of(resumed)
    assert event["batch_policy"] == "global" and event["global_batch_changed"] is False
    assert (event["saved_global_batch"], event["global_batch"]) == (10, 10)
    assert event["accumulation_steps"] == 1
    steps = surviving_steps(tmp_path / "rec")
    assert assert_each_sample_once(steps, N, seed=0, final_step=12) == {0: 0}
    sizes = [len(steps[s].samples) for s in range(1, 13)]
    assert sizes == [10] * 9 + [7, 10, 10]  # the epoch's tail: 7 on 3 ranks, no padding


def test_unreachable_global_batch_fails_before_training(tmp_path: Path) -> None:
    result = run_cli(["demo", f"--storage={tmp_path / 's'}", "--nproc=4",
                      "--global-batch-size=3"], tmp_path)
    assert result.returncode == 2
    assert "--global-batch-size=3 is not reachable with world size 4" in result.stderr
    assert "fix:" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "s").exists()  # nothing started, nothing written
    # Elastic: every size the job can take counts (1 or 2 nodes of 2 workers).
    result = run_cli(["demo", f"--storage={tmp_path / 's'}", "--nnodes=1:2", "--nproc=2",
                      "--batch-size=1", "--global-batch-size=6"], tmp_path)
    assert result.returncode == 2
    assert "--global-batch-size=6 is not reachable with world size 4 and per-rank batch 1" \
        in result.stderr


def test_other_dataset_length_fails_before_training(tmp_path: Path) -> None:
    demo(tmp_path, "--nproc=1", "--steps=2")
    runs_before = sorted((tmp_path / "ev").iterdir())
    result = run_cli(["demo", f"--storage={tmp_path / 's'}", "--samples=90", "--nproc=1",
                      f"--events-dir={tmp_path / 'ev'}"], tmp_path)
    assert result.returncode == 2
    assert "has 90 samples but the newest snapshot" in result.stderr
    assert f"was taken with {N}; fix: resume with --samples={N}" in result.stderr
    assert sorted((tmp_path / "ev").iterdir()) == runs_before  # no worker ever started
