"""``save()`` again at a step already saved by this process records what the user changed
since (``epoch += 1`` after the periodic save of an epoch's last step, a new best
loss in ``extras``): the second copy replaces the first, on a file system (by rename
otherwise) and on an object store, replicated and sharded. A relaunch reaching a step
an earlier attempt committed still keeps that copy."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

import elastictrain as et
from elastictrain.core import layout
from elastictrain.snapshot.format.reader import read_manifest, verify_snapshot
from elastictrain.storage import open_store
from tests.small_job import one_rank_fsdp2

STEPS = 4


@pytest.fixture(params=["local", "object store"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "run")
    return f"memory://save-again-{os.getpid()}-{uuid.uuid4().hex}"


def _job(url: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, et.SnapshotManager]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = et.SnapshotManager(url, model=model, optimizer=opt, every_steps=STEPS,
                              save_on_close=False)
    return model, opt, snap


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, snap: et.SnapshotManager,
           steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(2, 3)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        snap.step()


def _step_objects(url: str, step: int) -> list[str]:
    return sorted(open_store(url).list_dir(layout.step_dir(step)))


def test_a_second_save_at_the_same_step_records_the_change(url: str) -> None:
    model, opt, snap = _job(url)
    with capture_logs() as events:
        _train(model, opt, snap, STEPS)  # the periodic save of step 4: epoch 0
        snap.wait()
        snap.epoch += 1  # the tutorial's shape: the epoch ends, then save()
        snap.extras["best_val_loss"] = 0.25
        snap.save().wait()
        snap.close()
    assert [e["snapshot_step"] for e in events if e["event"] == "snapshot.replaced"] == [STEPS]
    assert not [e for e in events if e["event"] == "snapshot.exists"]
    store = open_store(url)
    manifest = read_manifest(store, STEPS)
    assert manifest.epoch == 1
    verify_snapshot(store, STEPS)
    # The first copy's payload is gone: one payload and the marker are left.
    objects = _step_objects(url, STEPS)
    assert len(objects) == 2 and layout.MANIFEST in objects, objects

    _, _, resumed = _job(url)
    assert resumed.restore().from_step == STEPS
    assert (resumed.epoch, resumed.extras["best_val_loss"]) == (1, 0.25)
    resumed.close()


def test_a_relaunch_reaching_a_committed_step_keeps_that_copy(url: str) -> None:
    """Not a second save by this process: an attempt resumed from step 0 that reaches
    step 4 again meets the earlier attempt's copy and keeps it, as before."""
    model, opt, snap = _job(url)
    _train(model, opt, snap, STEPS)
    snap.close()
    before = json.loads(open_store(url).read_bytes(f"{layout.step_dir(STEPS)}/MANIFEST.json"))

    model, opt, again = _job(url)  # no restore(): trains steps 1..4 again
    with capture_logs() as events:
        _train(model, opt, again, STEPS)
        again.close()
    assert [e["action"] for e in events if e["event"] == "snapshot.exists"] == ["kept"]
    assert not [e for e in events if e["event"] == "snapshot.replaced"]
    after = json.loads(open_store(url).read_bytes(f"{layout.step_dir(STEPS)}/MANIFEST.json"))
    assert after == before


def test_a_sharded_snapshot_saved_again_records_the_change(
        url: str, one_rank_group: None) -> None:
    model, opt = one_rank_fsdp2(3, 8)
    snap = et.SnapshotManager(url, model=model, optimizer=opt, every_steps=STEPS,
                              save_on_close=False)
    with capture_logs() as events:
        _train(model, opt, snap, STEPS)
        snap.wait()
        first = _step_objects(url, STEPS)
        snap.epoch = 3
        snap.save().wait()
        snap.close()
    assert [e["snapshot_step"] for e in events if e["event"] == "snapshot.replaced"] == [STEPS]
    store = open_store(url)
    assert read_manifest(store, STEPS).epoch == 3
    verify_snapshot(store, STEPS)
    # Every object of the first copy is gone; the second's are as many.
    second = _step_objects(url, STEPS)
    assert len(second) == len(first) and not set(second) & (set(first) - {layout.MANIFEST})
