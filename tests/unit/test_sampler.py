"""ElasticSampler: world-size-agnostic order, exact resume, documented epoch tails."""

from __future__ import annotations

from collections import Counter

import pytest

from elastictrain.data import ElasticSampler
from elastictrain.errors import ResumeMismatchError


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
