"""Copy behind with the process persister: the snapshot holds its own step while the loop
runs ahead of a copy held at a gate."""
from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from elastictrain.snapshot.format.reader import verify_snapshot
from elastictrain.storage import open_store
from tests.unit.snapshot.test_copy_behind import Gate, make, one_step

PERSISTERS = ["thread", "process"]
@pytest.mark.processes
@pytest.mark.parametrize("persister", PERSISTERS)
def test_the_snapshot_holds_its_own_step_while_the_loop_runs_ahead(
        tmp_path: Path, persister: str, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch)
    model, opt, snap = make(tmp_path, persister)
    for _ in range(5):
        one_step(model, opt)
        snap.step()  # step 5 saves; its copy behind is held at the gate
    expected = {"model": copy.deepcopy(model.state_dict()),
                "optimizer": copy.deepcopy(opt.state_dict()["state"])}
    assert gate.held() == 1
    # The next forward changes BatchNorm's running stats (buffers: copied at once) and
    # backward the gradients, while the copy is still held.
    loss = model(torch.randn(8, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opener = threading.Timer(0.2, gate.open)  # frees the copy while step() waits in the fence
    opener.start()
    with capture_logs() as logs:
        opt.step()  # the fence: returns only after the copy of step 5
    opener.join()
    snap.step()
    snap.close()
    waits = [e for e in logs if e["event"] == "snapshot.copy_wait"]
    assert len(waits) == 1 and waits[0]["snapshot_step"] == 5 and waits[0]["wait_s"] > 0
    saved = verify_snapshot(open_store(str(tmp_path)), 5, load=True).payload
    for name, value in expected["model"].items():
        assert torch.equal(saved["model"][name], value), name
    for index, state in expected["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(saved["optimizer"]["state"][index][key], value), (index, key)
    assert not torch.equal(saved["model"]["0.weight"], model.state_dict()["0.weight"])


