"""A torchdata ``StatefulDataLoader`` (two workers, prefetching) in ``state=``, in the
test's own process: a run stopped at any step, as a killed one (no last save), resumes
in a fresh manager with a fresh loader at the next batch, and its batches and final
weights equal an uninterrupted run's. The loader's workers are processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import elastictrain as et
from tests.stateful_loader_job import loader, model_and_optimizer, train

pytestmark = pytest.mark.processes

SAMPLES, EPOCHS = 40, 2  # 10 steps an epoch


def run(url: str, stop_at: int | None = None, every: int = 1
        ) -> tuple[torch.nn.Module, list[torch.Tensor], int]:
    """A fresh job: restore, train (to ``stop_at``); returns the model, the batches it
    trained and the step it resumed from."""
    model, opt = model_and_optimizer()
    data = loader(SAMPLES)
    snap = et.SnapshotManager(url, model=model, optimizer=opt, state={"loader": data},
                              every_steps=every, save_on_close=stop_at is None)
    info = snap.restore()
    seen = train(model, opt, data, snap, EPOCHS, stop_at=stop_at)
    snap.close()
    return model, seen, info.from_step or 0


@pytest.mark.parametrize(("stop_at", "every"), [(3, 1), (10, 1), (14, 4), (17, 5)])
def test_a_stopped_run_resumes_at_the_next_batch(tmp_path: Path, stop_at: int,
                                                  every: int) -> None:
    ref_model, ref_seen, _ = run(str(tmp_path / "ref"))
    url = str(tmp_path / "run")
    run(url, stop_at=stop_at, every=every)
    model, seen, resumed_from = run(url, every=every)
    assert resumed_from == stop_at - stop_at % every
    assert len(seen) == len(ref_seen) - resumed_from
    for got, want in zip(seen, ref_seen[resumed_from:], strict=True):
        assert torch.equal(got, want)
    for got, want in zip(model.state_dict().values(), ref_model.state_dict().values(),
                         strict=True):
        assert torch.equal(got, want)
