"""Batch policy arithmetic: uneven divisions, loss scales, reachability errors."""

from __future__ import annotations

import pytest
import torch

from elastictrain.core.errors import ConfigError
from elastictrain.worker.batching import check_global_batch, step_shape, tail_samples


def test_48_on_5_ranks_with_micro_batch_4() -> None:
    shape = step_shape(48, 5, 4)
    assert shape.micro_steps == 3
    assert [shape.share(r) for r in range(5)] == [10, 10, 10, 9, 9]
    assert [shape.micro_sizes(r) for r in range(5)] == [[4, 3, 3]] * 3 + [[3, 3, 3]] * 2
    assert shape.loss_scale(4) == pytest.approx(4 * 5 / 48)


def test_per_rank_policy_is_one_micro_batch_with_scale_one() -> None:
    shape = step_shape(4 * 3, 3, 4)
    assert shape.micro_steps == 1 and shape.micro_sizes(2) == [4] and shape.loss_scale(4) == 1.0


@pytest.mark.parametrize(("n", "world", "micro"), [(48, 5, 4), (7, 3, 2), (12, 4, 3), (10, 10, 1)])
def test_scaled_accumulation_equals_the_mean_gradient_of_the_step(n: int, world: int,
                                                                   micro: int) -> None:
    """What DDP computes (sum over micro-steps of scaled mean-loss gradients, averaged
    over ranks) is the gradient of the mean loss over the step's n samples."""
    torch.manual_seed(0)
    x, y = torch.randn(n, 3, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    ((x @ w - y) ** 2).mean().backward()
    assert w.grad is not None
    expected, w.grad = w.grad.clone(), None
    shape = step_shape(n, world, micro)
    per_rank = []
    for rank in range(world):
        mine = list(range(rank, n, world))
        grad = torch.zeros(3, dtype=torch.float64)
        offset = 0
        for size in shape.micro_sizes(rank):
            assert 1 <= size <= micro
            idx = mine[offset:offset + size]
            offset += size
            loss = ((x[idx] @ w - y[idx]) ** 2).mean() * shape.loss_scale(size)
            grad += torch.autograd.grad(loss, w)[0]
        assert offset == len(mine)
        per_rank.append(grad)
    assert torch.allclose(torch.stack(per_rank).mean(0), expected)


def test_global_batch_below_world_size_names_both_numbers() -> None:
    with pytest.raises(ConfigError, match=r"global_batch_size=3 .* world size 4 and per-rank "
                                          r"batch 2: .* fix: global_batch_size >= 4"):
        check_global_batch(3, 4, 2)


def test_uneven_global_batch_with_micro_batch_one_is_unreachable() -> None:
    with pytest.raises(ConfigError, match=r"--global-batch-size=10 is not reachable with world "
                                          r"size 4 and per-rank batch 1: .* \(8 or 12\)"):
        check_global_batch(10, 4, 1, name="--global-batch-size")
    check_global_batch(12, 4, 1)  # divisible: reachable
    check_global_batch(10, 4, 2)  # micro-batch 2 absorbs the uneven shares
    check_global_batch(None, 4, 1)


@pytest.mark.parametrize(("remaining", "equal", "drop", "expected"), [
    (7, True, False, 9), (7, True, True, 6), (6, True, False, 6),   # per-rank: multiple of W
    (7, False, False, 7), (2, False, False, 3), (2, False, True, 0),  # global: reachable size
])
def test_tail_of_an_epoch(remaining: int, equal: bool, drop: bool, expected: int) -> None:
    assert tail_samples(remaining, 3, 2, equal_shares=equal, drop_last=drop) == expected
