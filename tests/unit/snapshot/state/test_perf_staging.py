"""The first save: staging slabs are allocated ahead, off the training loop."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastictrain.core.errors import UnsafeStateError
from elastictrain.snapshot.state.staging import StagingBuffers
from tests.small_job import build_plain, train_plain


def _wait_prepared(buffers: StagingBuffers) -> None:
    thread = buffers._preparing
    assert thread is not None, "nothing is being prepared"
    thread.join(timeout=60)
    assert not thread.is_alive()


@pytest.mark.parametrize("share_memory", [False, True])
def test_prepared_buffers_are_the_ones_the_first_stage_uses(share_memory: bool) -> None:
    state = {"model": {"w": torch.randn(64, 32), "b": torch.randn(32)},
             "optimizer": {"state": {0: {"exp_avg": torch.randn(64, 32),
                                         "step": torch.tensor(3.0)}},
                           "param_groups": [{"lr": 0.1, "params": [0]}]},
             "rng": [torch.randint(0, 255, (16,), dtype=torch.uint8)], "step": 7}
    buffers = StagingBuffers(share_memory=share_memory)
    buffers.prepare_async(state)
    _wait_prepared(buffers)
    prepared = buffers.allocations
    assert prepared > 0 and buffers.nbytes >= 64 * 32 * 4 * 2
    staged = buffers.stage(state)
    assert buffers.allocations == prepared  # the first stage allocated nothing
    assert torch.equal(staged["model"]["w"], state["model"]["w"])
    assert torch.equal(staged["optimizer"]["state"][0]["exp_avg"],
                       state["optimizer"]["state"][0]["exp_avg"])
    assert staged["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()
    assert staged["model"]["w"].is_shared() == share_memory


def test_prepare_leaves_an_unsafe_state_to_the_save() -> None:
    buffers = StagingBuffers()
    state = {"model": {"w": torch.randn(4)}, "extras": {"f": object()}}
    buffers.prepare_async(state)
    assert buffers._preparing is None and buffers.allocations == 0
    with pytest.raises(UnsafeStateError, match="extras"):
        buffers.stage(state)


def test_a_second_prepare_allocates_only_what_is_new() -> None:
    model_only = {"model": {"w": torch.randn(64, 32)}, "optimizer": {"state": {}}}
    buffers = StagingBuffers()
    buffers.prepare_async(model_only)
    first = buffers._preparing
    with_optimizer = {"model": model_only["model"],
                      "optimizer": {"state": {0: {"exp_avg": torch.randn(64, 32)}}}}
    buffers.prepare_async(with_optimizer)  # chained after the first, not beside it
    _wait_prepared(buffers)
    assert first is not None and not first.is_alive()
    assert buffers.allocations == 2  # the model's slab once, then the optimizer's
    buffers.stage(with_optimizer)
    assert buffers.allocations == 2


@pytest.mark.parametrize("resumed", [False, True])
def test_restore_prepares_staging_before_the_loop_starts(tmp_path: Path,
                                                         resumed: bool) -> None:
    """The order a first save relies on (pinned slabs for CUDA state take seconds):
    ``restore()`` starts allocating the model's (and a resumed optimizer's) slabs, the
    first step the rest, and the first save allocates nothing."""
    if resumed:
        model, opt, snap = build_plain(str(tmp_path / "run"), every_steps=2)
        train_plain(model, opt, snap, until=2)
        snap.close()
    model, opt, snap = build_plain(str(tmp_path / "run"), every_steps=2 if resumed else 3, seed=1)
    staging = snap._saver.staging
    snap.restore()
    _wait_prepared(staging)
    at_restore = staging.allocations
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert at_restore > 0 and staging.nbytes >= model_bytes * (3 if resumed else 1)
    train_plain(model, opt, snap, until=snap.step_count + 1)
    _wait_prepared(staging)
    before_save = staging.allocations
    assert staging.nbytes >= model_bytes * 3  # the parameters and both AdamW moments
    train_plain(model, opt, snap, until=snap.step_count + 2)  # the first save of this attempt
    snap.wait()
    assert staging.allocations == before_save
    snap.close()


def test_close_right_after_restore_waits_for_the_allocation(tmp_path: Path) -> None:
    """A run resumed at its last step closes right after ``restore()``: the allocation
    that restore started ends before close returns (and is no daemon thread, which the
    interpreter's exit would tear down in the middle of an allocation)."""
    model, opt, snap = build_plain(str(tmp_path / "run"), every_steps=2)
    train_plain(model, opt, snap, until=2)
    snap.close()
    model, opt, snap = build_plain(str(tmp_path / "run"), every_steps=2, seed=1)
    snap.restore()
    thread = snap._saver.staging._preparing
    assert thread is not None and not thread.daemon
    snap.close()
    assert not thread.is_alive()


