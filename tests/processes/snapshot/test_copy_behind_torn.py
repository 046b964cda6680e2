"""Copy behind never commits a torn snapshot (issue 24, case 3).

An in-place kernel bumps its tensor's version only once it has finished, so a copy
that ends while one is still writing sees the old version and half the new values.
Here a real ``add_`` is held half-way through by a dispatch mode (which runs below
autograd's version bump, as a kernel does), the snapshot's copy runs to its end in
that window, and only then does the update finish: the race every time, no timing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs
from torch.utils._python_dispatch import TorchDispatchMode

from elastictrain.snapshot.format.reader import list_snapshot_dirs, verify_snapshot
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.storage import open_store

pytestmark = pytest.mark.processes


class HeldAdd(TorchDispatchMode):
    """``add_`` writes the first half of its tensor, says so, waits for ``release``,
    then writes the rest; autograd bumps the version after this returns."""

    def __init__(self) -> None:
        super().__init__()
        self.half_written = threading.Event()
        self.release = threading.Event()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is not torch.ops.aten.add_.Tensor:
            return func(*args, **(kwargs or {}))
        target, other = args[0], args[1]
        flat, half = target.view(-1), target.numel() // 2
        flat[:half].add_(other)  # below autograd here: no version bump
        self.half_written.set()
        assert self.release.wait(timeout=60)
        flat[half:].add_(other)
        return target


def _step(model: torch.nn.Linear, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(4, model.in_features)).sum().backward()
    opt.step()


def _in_thread(work: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=work, name="held-update")
    thread.start()
    return thread


@pytest.mark.parametrize("persister", ["thread", "process"])
def test_an_update_still_running_when_the_copy_ends_drops_that_snapshot(
        tmp_path: Path, persister: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 256)  # weight: 16384 values
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = SnapshotManager(str(tmp_path), model=model, optimizer=opt, every_steps=5,
                           overlap_copy=True, persister=persister)
    for _ in range(4):
        _step(model, opt)
        snap.step()
    _step(model, opt)
    weight = model.weight
    before = weight.detach().clone()
    held = HeldAdd()

    def update() -> None:  # an update outside optimizer.step(), as a second optimizer's
        with torch.no_grad(), held:
            weight.add_(1.0)
    updater = _in_thread(update)
    assert held.half_written.wait(timeout=60)
    version = weight._version  # the kernel is mid-flight: no bump yet
    with capture_logs() as logs:
        snap.step()  # step 5 saves; the weight is deferred to the copy thread
        saver = snap._saver
        assert saver.copy_behind  # the durable saver copies behind
        behind = saver._behind
        assert behind is not None and behind.copied.wait(timeout=60)
        assert weight._version == version  # the copy ended while the update ran
        held.release.set()
        updater.join()  # the op returned to its caller: now the version moves
        assert weight._version == version + 1
        _step(model, opt)  # the fence, in the optimizer's step pre-hook
        snap.close()
    store = open_store(str(tmp_path))
    if 5 in list_snapshot_dirs(store):  # say what was committed: half of each value
        payload = verify_snapshot(store, 5, load=True).payload
        assert payload is not None
        saved = payload["model"]["weight"].view(-1)
        moved = (saved != before.view(-1)).sum().item()
        raise AssertionError(f"step 5 committed with {moved} of {saved.numel()} values "
                             "updated (a torn copy)")
    raced = [e for e in logs if e["event"] == "snapshot.copy_raced"]
    assert [e["snapshot_step"] for e in raced] == [5]


@pytest.mark.parametrize("persister", ["thread", "process"])
def test_a_wait_on_the_save_itself_judges_the_copy_and_commits_it(
        tmp_path: Path, persister: str) -> None:
    """``snap.save().wait()`` with no optimizer step in between: the wait runs the
    verdict itself (it would wait forever for a fence otherwise) and commits."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = SnapshotManager(str(tmp_path), model=model, optimizer=opt, every_steps=100,
                           overlap_copy=True, persister=persister)
    _step(model, opt)
    snap.step()
    expected = model.weight.detach().clone()
    with capture_logs() as logs:
        manifest = snap.save().wait(timeout=60)
    assert manifest is not None and manifest.step == 1
    assert [e["copy_behind"] for e in logs if e["event"] == "snapshot.staged"] == [2]
    saved = verify_snapshot(open_store(str(tmp_path)), 1, load=True).payload
    assert saved is not None and torch.equal(saved["model"]["weight"], expected)
    snap.close()
