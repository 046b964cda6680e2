"""ElasticSampler: world-size-agnostic order, exact resume, documented epoch tails."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from elastictrain.core.errors import ConfigError, ResumeMismatchError
from elastictrain.worker.data import ElasticSampler, MicroBatchSampler, optimizer_steps


def ranks(n: int, world: int, batch: int = 4, **kw: object) -> list[ElasticSampler]:
    return [ElasticSampler(n, batch, r, world, **kw) for r in range(world)]  # type: ignore[arg-type]


def consume(samplers: list[ElasticSampler], steps: int) -> list[int]:
    """Run ``steps`` steps; return the samples trained, in order."""
    seen: list[int] = []
    shards = [list(s) for s in samplers]
    b = samplers[0].batch_size
    for k in range(steps):
        for shard in shards:
            seen += shard[k * b:(k + 1) * b]
        for s in samplers:
            s.advance()
    return seen


def test_order_depends_only_on_seed_and_epoch() -> None:
    a = ElasticSampler(50, 4, 0, 1, seed=3)
    b = ElasticSampler(50, 4, 1, 4, seed=3)
    assert a.epoch_order(2) == b.epoch_order(2)
    assert a.epoch_order(1) != a.epoch_order(2)
    assert sorted(a.epoch_order(0)) == list(range(50))


@pytest.mark.parametrize(("world_before", "world_after"), [(2, 2), (2, 1), (2, 3), (3, 2)])
def test_resume_at_any_world_size_sees_each_sample_once(world_before: int,
                                                        world_after: int) -> None:
    n = 97
    before = ranks(n, world_before, seed=7)
    seen = consume(before, 5)
    after = ranks(n, world_after, seed=7)
    for s in after:
        s.load_state_dict(before[0].state_dict())
    pad = after[0].epoch_padding()
    seen += consume(after, len(after[0]) // 4 + 1)
    # Exactly once, except the documented tail padding: the epoch's first `pad` samples.
    expected = Counter(range(n)) + Counter(after[0].epoch_order()[:pad])
    assert Counter(seen) == expected and 0 <= pad < world_after


def test_padding_and_drop_last_are_reported() -> None:
    padded = ranks(10, 3)
    assert padded[0].epoch_padding() == 2 and sum(len(s) for s in padded) == 12
    dropped = ranks(10, 3, drop_last=True)
    assert dropped[0].epoch_padding() == -1 and sum(len(s) for s in dropped) == 9
    union = [i for s in padded for i in s]
    assert set(union) == set(range(10))


def test_padding_is_independent_of_resume_point() -> None:
    fresh = ranks(23, 2, batch=2, seed=1)
    tail_fresh = [list(s)[-1] for s in fresh]
    resumed = ranks(23, 2, batch=2, seed=1)
    for s in resumed:
        s.load_state_dict({**fresh[0].state_dict(), "cursor": 8})
    assert [list(s)[-1] for s in resumed] == tail_fresh


def test_set_epoch_keeps_cursor_of_current_epoch() -> None:
    s = ElasticSampler(40, 4, 0, 2)
    s.advance()
    s.set_epoch(0)
    assert s.cursor == 8
    s.set_epoch(1)
    assert (s.epoch, s.cursor) == (1, 0)


def test_resume_with_other_dataset_length_names_both() -> None:
    s = ElasticSampler(100, 4)
    with pytest.raises(ResumeMismatchError, match=r"dataset has 100 samples .* with 90"):
        s.load_state_dict({**s.state_dict(), "dataset_len": 90})


# -- global batch policy (gradient accumulation) -------------------------------------------
def run_steps(samplers: list[ElasticSampler], steps: int) -> list[list[int]]:
    """Run up to ``steps`` optimizer steps on every rank; return each step's samples."""
    trained: list[list[int]] = []
    for _ in range(steps):
        plans = [next(s.steps(), None) for s in samplers]
        if plans[0] is None:
            break
        assert len({p.shape.micro_steps for p in plans if p}) == 1  # same count on every rank
        trained.append([i for p in plans if p for m in p.micros for i in m.indices])
        for s in samplers:
            s.advance()
    return trained


def resume(samplers: list[ElasticSampler], world: int, **kw: object) -> list[ElasticSampler]:
    state = samplers[0].state_dict()
    after = ranks(state["dataset_len"], world, batch=state["batch_size"], **kw)
    for s in after:
        s.load_state_dict(state)
    return after


def test_global_batch_survives_shrink_and_grow_inside_an_epoch() -> None:
    n, g = 125, 12  # 10 full steps and a tail of 5
    kw = {"seed": 5, "global_batch_size": g}
    worlds = ranks(n, 2, batch=3, **kw)
    steps = run_steps(worlds, 3)
    for world in (5, 1, 3):  # 12 on 5 ranks: shares 3,3,2,2,2 in one micro-batch of <= 3
        worlds = resume(worlds, world, **kw)
        steps += run_steps(worlds, 2)
    steps += run_steps(worlds, 100)
    assert [len(s) for s in steps[:-1]] == [g] * (len(steps) - 1)  # every full step trains G
    assert len(steps[-1]) == n % g  # 5 left on 3 ranks: reachable, so no padding
    assert Counter(i for s in steps for i in s) == Counter(range(n))
    assert worlds[0].epoch_done


def test_global_tail_shorter_than_the_world_is_padded_from_the_epoch_start() -> None:
    samplers = ranks(26, 4, batch=2, seed=2, global_batch_size=8)  # 8, 8, 8, then 2 < 4 ranks
    assert samplers[0].epoch_padding() == 2
    steps = run_steps(samplers, 10)
    assert [len(s) for s in steps] == [8, 8, 8, 4]
    extra = Counter(samplers[0].epoch_order()[:2])
    assert Counter(i for s in steps for i in s) == Counter(range(26)) + extra


def test_accumulation_steps_follow_the_world_size() -> None:
    small = ElasticSampler(1000, 4, 0, 2, global_batch_size=48)
    big = ElasticSampler(1000, 4, 0, 5, global_batch_size=48)
    plan_small, plan_big = next(small.steps()), next(big.steps())
    assert [len(m.indices) for m in plan_small.micros] == [4] * 6
    assert [len(m.indices) for m in plan_big.micros] == [4, 3, 3]
    assert [m.last for m in plan_big.micros] == [False, False, True]


def test_unreachable_global_batch_fails_at_construction_and_on_resume() -> None:
    with pytest.raises(ConfigError, match=r"global_batch_size=3 .* world size 4"):
        ElasticSampler(100, 2, 0, 4, global_batch_size=3)
    s = ElasticSampler(100, 1, 0, 2, global_batch_size=6)
    with pytest.raises(ConfigError, match=r"global_batch_size=6 .* world size 4 and per-rank "
                                          r"batch 1"):
        s.set_world(0, 4)
    assert s.world_size == 2  # unchanged


def test_resume_fields_report_the_global_batch_change() -> None:
    before = ElasticSampler(100, 4, 0, 2)
    after = ElasticSampler(100, 4, 0, 3)
    fields = after.resume_fields(before.state_dict())
    assert fields["batch_policy"] == "per_rank"
    assert (fields["saved_global_batch"], fields["global_batch"]) == (8, 12)
    assert fields["global_batch_changed"] is True
    kept = ElasticSampler(100, 4, 0, 3, global_batch_size=8).resume_fields(
        ElasticSampler(100, 4, 0, 2, global_batch_size=8).state_dict())
    assert kept["global_batch_changed"] is False and kept["accumulation_steps"] == 1


def test_micro_batch_sampler_drives_a_dataloader_by_optimizer_step() -> None:
    data = TensorDataset(torch.arange(30))
    sampler = ElasticSampler(30, 4, 1, 3, seed=1, global_batch_size=14)
    loader = DataLoader(data, batch_sampler=MicroBatchSampler(sampler))
    seen: list[int] = []
    expected = [i for p in sampler.steps() for m in p.micros for i in m.indices]
    for step in optimizer_steps(loader):
        assert [m.index for m, _ in step] == list(range(step[0][0].count))
        for micro, (batch,) in step:
            assert batch.tolist() == list(micro.indices)
            seen += batch.tolist()
        sampler.advance()
    assert seen == expected and sampler.epoch_done


def test_plain_sampler_loader_is_one_micro_batch_per_step() -> None:
    sampler = ElasticSampler(20, 4, 0, 2, seed=3)
    loader = DataLoader(TensorDataset(torch.arange(20)), batch_size=4, sampler=sampler)
    steps = list(optimizer_steps(loader))
    assert [len(s) for s in steps] == [1] * 3 and all(m.loss_scale == 1.0 for s in steps
                                                      for m, _ in s)
    assert [i for s in steps for _, (b,) in s for i in b.tolist()] == list(sampler)


def test_any_sequence_of_world_sizes_trains_each_sample_once() -> None:
    """Random datasets, batch policies and world-size changes inside one epoch:
    every sample exactly once, except the documented tail (padding from the epoch's
    start, or dropped samples from its end), fewer than the world size."""
    rng = random.Random(0)
    for _ in range(400):
        n, m, drop = rng.randint(1, 80), rng.randint(1, 4), rng.random() < 0.3
        g = rng.choice([None, rng.randint(1, 30)])
        worlds = [rng.randint(1, 6) for _ in range(4)]
        if g is not None and not all(g >= w and (m >= 2 or g % w == 0) for w in worlds):
            continue
        kw = {"seed": 1, "drop_last": drop, "global_batch_size": g}
        samplers = ranks(n, worlds[0], batch=m, **kw)
        steps: list[list[int]] = []
        for k, world in enumerate(worlds):
            samplers = resume(samplers, world, **kw) if k else samplers
            pad = samplers[0].epoch_padding()  # what the tail will be if it runs at this size
            steps += run_steps(samplers, rng.randint(0, 4) if k < len(worlds) - 1 else n)
            if not samplers[0].epoch_done:
                continue
            order = samplers[0].epoch_order()
            if pad >= 0:
                expected = Counter(range(n)) + Counter(order[i % n] for i in range(pad))
            else:
                expected = Counter(order[: n + pad])
            assert Counter(i for s in steps for i in s) == expected and abs(pad) < world
            if g is not None:
                assert all(len(s) == g for s in steps[:-1])
            break
        else:
            pytest.fail("the epoch never ended")
