"""The first save with each persister finds its staging slabs allocated after the first
step, off the training loop."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.small_job import ASYNC, build_plain, train_plain
from tests.unit.snapshot.state.test_perf_staging import _wait_prepared


@pytest.mark.processes
@pytest.mark.parametrize("persister", ASYNC)
def test_first_save_finds_its_slabs_allocated_after_the_first_step(tmp_path: Path,
                                                                    persister: str) -> None:
    model, opt, snap = build_plain(str(tmp_path / "run"), persister, every_steps=3)
    staging = snap._saver.staging
    train_plain(model, opt, snap, until=1)  # AdamW's state exists from here on
    _wait_prepared(staging)
    before_save = staging.allocations
    assert before_save > 0
    train_plain(model, opt, snap, until=3)  # step 3 saves
    snap.wait()
    assert staging.allocations == before_save  # model, optimizer and RNG were all ahead
    snap.close()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    model2, _, again = build_plain(str(tmp_path / "run"), persister, seed=1, every_steps=3)
    assert again.restore().from_step == 3
    again.close()
    for name, value in model2.state_dict().items():
        assert torch.equal(value, expected[name])


