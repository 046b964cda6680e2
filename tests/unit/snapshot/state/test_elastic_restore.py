"""SnapshotManager.restore at another world size, in one process: the snapshot of a
1-rank job restored as rank 0 of a larger world (a context without a process group;
real multi-process resumes are in tests/e2e)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

import elastictrain as et
from elastictrain.core.errors import ConfigError, ResumeMismatchError
from elastictrain.snapshot.state.rng import capture_rng, reseed_for_new_world
from elastictrain.worker.dist import DistContext


def ctx(rank: int, world: int) -> DistContext:
    return DistContext(rank, world, 0, "gloo", torch.device("cpu"), False)


def job(url: str, rank: int = 0, world: int = 1, n: int = 100,
        **kw: Any) -> tuple[torch.nn.Module, et.ElasticSampler, et.SnapshotManager]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    sampler = et.ElasticSampler(n, 4, rank, world, seed=2, **kw)
    snap = et.SnapshotManager(url, model=model, sampler=sampler, ctx=ctx(rank, world),
                              every_steps=5)
    return model, sampler, snap


def run(model: torch.nn.Module, snap: et.SnapshotManager, steps: int) -> None:
    for _ in range(steps):
        with torch.no_grad():
            model.weight.add_(torch.rand(1, 3))  # consumes RNG, changes the state
        snap.step()
    snap.close()


def resume_event(logs: list[dict[str, Any]]) -> dict[str, Any]:
    (event,) = [e for e in logs if e["event"] == "resume"]
    return event


def test_shrunk_or_grown_world_resumes_at_the_global_cursor(tmp_path: Path) -> None:
    model, _, snap = job(str(tmp_path))
    run(model, snap, 5)  # 5 steps x 4 samples at world 1: cursor 20
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model2, sampler2, snap2 = job(str(tmp_path), rank=0, world=3)
    with capture_logs() as logs:
        snap2.restore()
    assert all(torch.equal(saved[k], v) for k, v in model2.state_dict().items())
    assert (sampler2.cursor, sampler2.rank, sampler2.world_size) == (20, 0, 3)
    assert list(sampler2) == sampler2.epoch_order()[20::3]
    event = resume_event(logs)
    assert (event["saved_world_size"], event["world_size"], event["world_size_changed"]) == (
        1, 3, True)
    assert event["batch_policy"] == "per_rank"
    assert (event["saved_global_batch"], event["global_batch"]) == (4, 12)
    assert event["global_batch_changed"] is True and event["rng"] == "reseeded"


def test_reseed_after_a_world_change_is_deterministic_and_per_rank(tmp_path: Path) -> None:
    model, _, snap = job(str(tmp_path))
    run(model, snap, 5)
    draws = []
    for _ in range(2):
        *_, again = job(str(tmp_path), rank=0, world=2)
        again.restore()
        draws.append(torch.rand(4))
    assert torch.equal(draws[0], draws[1])
    base = capture_rng()
    seeds = {reseed_for_new_world(base, 5, rank) for rank in range(4)}
    assert len(seeds) == 4 and reseed_for_new_world(base, 5, 2) in seeds


def test_same_world_restores_each_rank_state(tmp_path: Path) -> None:
    model, _, snap = job(str(tmp_path))
    run(model, snap, 5)
    expected = torch.rand(4)  # what the uninterrupted run draws next
    *_, again = job(str(tmp_path))
    with capture_logs() as logs:
        again.restore()
    assert torch.equal(torch.rand(4), expected)
    assert resume_event(logs)["rng"] == "restored"


def test_global_batch_is_kept_across_world_sizes(tmp_path: Path) -> None:
    model, _, snap = job(str(tmp_path), global_batch_size=12)
    run(model, snap, 5)
    *_, sampler, again = job(str(tmp_path), rank=0, world=2, global_batch_size=12)
    with capture_logs() as logs:
        again.restore()
    event = resume_event(logs)
    assert event["batch_policy"] == "global" and event["global_batch_changed"] is False
    assert (event["saved_global_batch"], event["global_batch"]) == (12, 12)
    assert event["accumulation_steps"] == 2 and sampler.cursor == 60  # 12 on 2 x 4: 2 micro


def test_other_dataset_length_fails_before_anything_is_loaded(tmp_path: Path) -> None:
    model, _, snap = job(str(tmp_path))
    run(model, snap, 5)
    fresh, _, other = job(str(tmp_path), n=30)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ResumeMismatchError, match="dataset has 30 samples but the snapshot "
                                                  "was taken with 100; fix:"):
        other.restore()
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    assert other.step_count == 0


def test_unreachable_global_batch_at_the_new_size_fails_on_restore(tmp_path: Path) -> None:
    model, _, snap = job(str(tmp_path), global_batch_size=5)
    run(model, snap, 5)
    with pytest.raises(ConfigError, match="global_batch_size=5 is not reachable with world "
                                          "size 6"):
        job(str(tmp_path), rank=0, world=6, global_batch_size=5)
