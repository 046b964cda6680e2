"""Copy behind (``snapshot.overlap_copy``): parameters and optimizer state are copied
while the next forward and backward run, and the optimizer's next step waits for
the copy. The copy thread is held at a gate here, so the loop is certain to run
ahead of it: a snapshot that mixed two steps, or a buffer copied late, shows."""
from __future__ import annotations

import copy
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from elastictrain.core.errors import ConfigError
from elastictrain.runlog.accounting.split import split_run
from elastictrain.snapshot.durable import saver as saver_module
from elastictrain.snapshot.format.reader import list_snapshot_dirs, verify_snapshot
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.storage import open_store


class Gate:
    """Holds every copy-behind thread until ``open()``; counts the holds."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.event = threading.Event()
        self._entered = threading.Condition()
        self._held = 0
        run = saver_module._CopyBehind._run

        def held_run(behind: Any) -> None:
            with self._entered:
                self._held += 1
                self._entered.notify_all()
            self.event.wait()
            run(behind)
        monkeypatch.setattr(saver_module._CopyBehind, "_run", held_run)

    def held(self) -> int:
        """How many copies behind have reached the gate, once one has (the saver's copy
        thread picks a save up asynchronously)."""
        with self._entered:
            self._entered.wait_for(lambda: self._held > 0, timeout=30)
            return self._held

    def open(self) -> None:
        self.event.set()


def make(root: Path, persister: str, **kw: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                                         SnapshotManager]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    kw.setdefault("overlap_copy", True)
    snap = SnapshotManager(str(root), model=model, optimizer=opt, persister=persister,
                           every_steps=5, **kw)
    return model, opt, snap


def one_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(8, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def train_until(root: Path, steps: int, restore: int | None = None, **kw: Any) -> None:
    """Train from seed 1 (or resume, expecting step ``restore``) up to ``steps``."""
    model, opt, snap = make(root, "thread", **kw)
    if restore is None:
        torch.manual_seed(1)
    else:  # the RNG too: the data of the next steps follows
        assert snap.restore().from_step == restore
    while snap.step_count < steps:
        one_step(model, opt)
        snap.step()
    snap.close()


def test_resume_from_a_copied_behind_snapshot_is_bit_exact(tmp_path: Path) -> None:
    train_until(tmp_path / "ref", 12, overlap_copy=False)
    train_until(tmp_path / "run", 8, save_on_close=False)  # as if killed after step 8
    train_until(tmp_path / "run", 12, restore=5)
    ref_run = copy.deepcopy(verify_snapshot(open_store(str(tmp_path / "ref")), 10,
                                            load=True).payload)
    run = verify_snapshot(open_store(str(tmp_path / "run")), 10, load=True).payload
    for name, value in ref_run["model"].items():
        assert torch.equal(run["model"][name], value), name


def test_overlap_copy_needs_an_optimizer_and_async_mode(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"snapshot.overlap_copy=true: no torch.optim "
                                          r"optimizer.*fix: pass a torch.optim optimizer"):
        SnapshotManager(str(tmp_path), model=model, overlap_copy=True)
    with pytest.raises(ConfigError, match=r"overlap_copy.*mode='async'.*fix"):
        SnapshotManager(str(tmp_path), model=model, overlap_copy=True, mode="sync",
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("change", ["second optimizer", "in-place update"])
def test_a_source_changed_before_its_copy_drops_that_snapshot_and_copies_at_once_after(
        tmp_path: Path, change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The window between a save and the manager's optimizer's next step is the
    copy's: a change there (an optimizer the manager does not know, an update of the
    weights outside optimizer.step()) moves the tensor's version, so the mixed
    snapshot is never committed, and the saves after it copy at once."""
    gate = Gate(monkeypatch)
    model, opt, snap = make(tmp_path, "thread", overlap_copy="auto")
    other = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(5):
        one_step(model, opt)
        snap.step()  # step 5 saves; its copy is held
    assert gate.held() == 1
    loss = model(torch.randn(8, 8)).pow(2).mean()
    loss.backward()
    if change == "second optimizer":
        other.step()
    else:
        with torch.no_grad():
            model[0].weight.mul_(0.5)
    with capture_logs() as logs:
        gate.open()
        opt.step()  # the fence
        for _ in range(5):
            one_step(model, opt)
            snap.step()  # step 10: copied at once
        snap.close()
    raced = [e for e in logs if e["event"] == "snapshot.copy_raced"]
    assert [e["snapshot_step"] for e in raced] == [5]
    assert "fix" in raced[0] and raced[0]["tensor"].startswith("torch.float32")
    staged = {e["snapshot_step"]: e["copy_behind"] for e in logs
              if e["event"] == "snapshot.staged"}
    assert staged == {10: 0}
    store = open_store(str(tmp_path))
    assert list_snapshot_dirs(store) == [10]  # 5 was never committed
    saved = verify_snapshot(store, 10, load=True).payload
    for name, value in model.state_dict().items():
        assert torch.equal(saved["model"][name], value), name


def test_auto_copies_behind_where_it_applies_and_quietly_not_elsewhere(
        tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    on = SnapshotManager(str(tmp_path / "on"), model=model, optimizer=sgd)
    assert on.config.overlap_copy == "auto" and on._fence.active
    on.close()
    for kw in ({}, {"mode": "sync", "optimizer": sgd}, {"overlap_copy": False,
                                                         "optimizer": sgd}):
        off = SnapshotManager(str(tmp_path / "off"), model=model, **kw)
        assert not off._fence.active and off._fence.deferred() == frozenset()
        off.close()


def test_goodput_counts_the_copy_wait_as_snapshot_blocking(tmp_path: Path) -> None:
    d = tmp_path / "events"
    d.mkdir()
    lines = [{"event": "worker.start", "ts": 0.0, "step": None},
             {"event": "resume", "ts": 1.0, "step": 0, "from_step": None, "lost_steps": 0},
             {"event": "snapshot.staged", "ts": 2.0, "step": 5, "snapshot_step": 5,
              "duration_s": 0.1},
             {"event": "snapshot.copy_wait", "ts": 2.5, "step": 5, "snapshot_step": 5,
              "wait_s": 0.3, "tier": "durable"},
             {"event": "run.finished", "ts": 4.0, "step": 10}]
    (d / "attempt000-rank0.jsonl").write_text("".join(
        json.dumps(e) + "\n" for e in lines))
    split = split_run(d)
    assert split.seconds["snapshot_blocking"] == pytest.approx(0.4)


def test_the_final_digest_covers_a_model_with_zero_dim_buffers() -> None:
    """BatchNorm's num_batches_tracked is a 0-d long tensor: close() logged the digest
    by viewing each tensor as bytes, which a 0-d tensor cannot do (found here)."""
    from elastictrain.snapshot.format.digest import param_digest

    model = torch.nn.BatchNorm1d(4)
    before = param_digest(model)
    model(torch.randn(3, 4))
    assert param_digest(model) != before  # running stats and the counter moved


