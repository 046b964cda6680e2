"""Virtual shards (ElasticSampler(virtual_shards=V)) and their fixed-order gradient sum
(worker/shard_sum.py), in one process: the shards do not depend on the world size, and
the sum is the shards' gradients added in shard order. The same bits at 1 to 5 ranks:
tests/processes/distributed/test_shard_sum_ranks.py; a run resized 4→3→2→4:
tests/processes/multinode/test_resize_exact.py."""

from __future__ import annotations

import pytest
import torch

from elastictrain.core.errors import ConfigError
from elastictrain.worker.data import ElasticSampler, Micro, shard_bounds
from elastictrain.worker.shard_sum import ShardSum


def _shards_of_world(world: int, **kwargs: object) -> dict[int, tuple[tuple[int, ...], float,
                                                                     int | None]]:
    """Every shard of the first step, from all ranks of a ``world``-rank job."""
    found = {}
    for rank in range(world):
        sampler = ElasticSampler(100, 4, rank, world, seed=3, global_batch_size=24,
                                 virtual_shards=6, **kwargs)  # type: ignore[arg-type]
        plan = next(sampler.steps())
        for micro in plan.micros:
            assert micro.shard is not None and micro.shard % world == rank
            found[micro.shard] = (micro.indices, micro.loss_scale, micro.seed)
    return found


def test_shards_are_the_same_at_any_world_size() -> None:
    one = _shards_of_world(1)
    assert sorted(one) == list(range(6))
    assert all(len(indices) == 4 and scale == 4 / 24 for indices, scale, _ in one.values())
    for world in (2, 3, 4, 5, 6, 7):
        assert _shards_of_world(world) == one, world
    assert len({seed for _, _, seed in one.values()}) == 6


def test_the_epochs_tail_is_trained_as_it_is_at_any_world_size() -> None:
    def tail(world: int, **kwargs: object) -> list[tuple[int, tuple[int, ...], float]]:
        got = []
        for rank in range(world):
            sampler = ElasticSampler(100, 4, rank, world, global_batch_size=24,
                                     virtual_shards=6, **kwargs)  # type: ignore[arg-type]
            *_, last = sampler.steps()
            got += [(m.shard, m.indices, m.loss_scale) for m in last.micros]
        return sorted(got)  # type: ignore[arg-type]

    # 100 = 4 x 24 + 4: the tail's 4 samples are 4 shards of one, shards 4 and 5 empty.
    assert [(v, len(i), s) for v, i, s in tail(1)] == [(v, 1, 0.25) for v in range(4)]
    assert tail(3) == tail(1) == tail(5)
    assert ElasticSampler(100, 4, 0, 3, global_batch_size=24, virtual_shards=6).epoch_padding() == 0
    dropped = ElasticSampler(100, 4, 0, 3, global_batch_size=24, virtual_shards=6,
                             drop_last=True)
    assert len(list(dropped.steps())) == 4 and dropped.epoch_padding() == -4


def test_shard_bounds_cut_as_equal_as_possible() -> None:
    assert shard_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert shard_bounds(2, 4) == [(0, 1), (1, 2)]


def test_virtual_shards_need_a_global_batch_that_fits_them() -> None:
    with pytest.raises(ConfigError, match="also pass global_batch_size"):
        ElasticSampler(100, 4, virtual_shards=6)
    with pytest.raises(ConfigError, match=r"shards of up to 8 samples, more than the per-rank "
                                          r"batch 4; fix: virtual_shards >= 6"):
        ElasticSampler(100, 4, global_batch_size=24, virtual_shards=3)
    with pytest.raises(ConfigError, match="between 1 and the global batch"):
        ElasticSampler(100, 4, global_batch_size=24, virtual_shards=25)


def test_a_resume_says_when_the_shard_count_changed() -> None:
    saved = ElasticSampler(100, 4, 0, 4, global_batch_size=24, virtual_shards=6).state_dict()
    now = ElasticSampler(100, 4, 0, 3, global_batch_size=24, virtual_shards=12)
    fields = now.resume_fields(saved)
    assert fields["virtual_shards"] == 12 and fields["virtual_shards_changed"] is True


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Dropout(0.3),
                               torch.nn.Linear(7, 2))


def _loss(model: torch.nn.Module, micro: Micro) -> torch.Tensor:
    x = torch.stack([torch.full((5,), float(i)) * 0.01 for i in micro.indices])
    return model(x).pow(2).mean() * micro.loss_scale


def test_the_sum_is_the_shards_gradients_added_in_shard_order() -> None:
    sampler = ElasticSampler(100, 4, global_batch_size=24, virtual_shards=6)
    plan = next(sampler.steps())
    model = _model()
    expected: torch.Tensor | None = None
    for micro in plan.micros:  # by hand: each shard alone, with its seed, added in order
        model.zero_grad(set_to_none=True)
        torch.manual_seed(micro.seed or 0)
        _loss(model, micro).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]
        expected = flat if expected is None else expected + flat
    model.zero_grad(set_to_none=True)

    shards = ShardSum(model)
    before = torch.random.get_rng_state()
    for micro in reversed(plan.micros):  # run in any order: summed in shard order
        with shards.shard(micro):
            _loss(model, micro).backward()
    assert torch.equal(torch.random.get_rng_state(), before)  # the loop's stream untouched
    shards.reduce()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]
    assert expected is not None and torch.equal(got, expected)


def test_misuse_is_a_clear_error() -> None:
    model = _model()
    shards = ShardSum(model)
    with pytest.raises(ConfigError, match="virtual_shards"), shards.shard(Micro(0, 1, (1,), 1.0)):
        pass
    micro = next(ElasticSampler(100, 4, global_batch_size=24, virtual_shards=6).steps()).micros[0]
    with shards.shard(micro):
        _loss(model, micro).backward()
    with pytest.raises(ConfigError, match="ran twice"), shards.shard(micro):
        pass
    with pytest.raises(ConfigError, match="1 ran their backward"):
        shards.reduce()  # the step's other shards never ran
    mixed = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double())
    with pytest.raises(ConfigError, match="one dtype and device"):
        ShardSum(mixed)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_backward_that_replaces_the_gradient_is_kept_too() -> None:
    """``create_graph=True`` makes autograd replace ``.grad`` instead of adding into it."""
    sampler = ElasticSampler(100, 4, global_batch_size=24, virtual_shards=6)
    plan = next(sampler.steps())
    sums = []
    for create_graph in (False, True):
        model = _model()
        shards = ShardSum(model)
        for micro in plan.micros:
            with shards.shard(micro):
                _loss(model, micro).backward(create_graph=create_graph)
        shards.reduce()
        sums.append(torch.cat([p.grad.detach().reshape(-1)  # type: ignore[union-attr]
                               for p in model.parameters()]))
    assert torch.equal(sums[0], sums[1]) and bool(sums[0].abs().sum() > 0)
