"""Under real torchrun: a committed snapshot whose payload verifies but that
``torch.load(weights_only=True)`` refuses stops every worker with exit 78 (issue 9,
case 1). Before, local disk called it corrupt and quietly resumed from an older
snapshot (or step 0). The worker's exit code comes from ``SnapshotUnloadable``
through ``et.init()``'s exit handling."""

from __future__ import annotations

import pathlib
import re
import sys
from pathlib import Path

import pytest

from elastictrain.core.errors import EXIT_FATAL
from elastictrain.snapshot.format.reader import list_snapshot_dirs, verify_snapshot
from elastictrain.storage import open_store
from tests.helpers import REPO, TRAIN_JOB, events, started
from tests.planted import plant_snapshot

pytestmark = pytest.mark.distributed


def torchrun(tmp_path: Path, name: str, *args: str) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--max-restarts=0", "--monitor-interval=0.1", "--rdzv-backend=c10d",
           "--rdzv-endpoint=127.0.0.1:0", f"--log-dir={tmp_path / name}",
           str(TRAIN_JOB), *args, "--every=5"]
    with started(cmd, tmp_path, f"{name}.log", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                 ELASTICTRAIN_LOG__EVENTS_DIR=str(tmp_path / name / "ev"),
                 PYTHONPATH=str(REPO)) as proc:
        code = proc.wait(timeout=240)
    return code, (tmp_path / f"{name}.log").read_text()


def test_an_unloadable_newest_snapshot_stops_every_worker_with_78(tmp_path: Path) -> None:
    root = tmp_path / "run"
    code, log = torchrun(tmp_path, "first", str(root), "10")
    assert code == 0, log[-4000:]
    store = open_store(str(root))
    state = verify_snapshot(store, 10, load=True).payload
    assert state is not None
    state["extras"] = {"data_dir": pathlib.Path("/data")}  # what weights_only refuses
    plant_snapshot(store, 15, state, world_size=2)

    code, log = torchrun(tmp_path, "second", str(root), "20")
    assert code != 0, log[-4000:]
    # The first worker to exit 78 ends the group: torchrun SIGTERMs (-15) any still up.
    codes = {int(c) for c in re.findall(r"exitcode  : (-?\d+)", log)}
    assert EXIT_FATAL in codes and codes <= {EXIT_FATAL, -15}, log[-4000:]
    ev = tmp_path / "second" / "ev"
    assert not events(ev, "resume")  # neither an older snapshot nor a fresh start
    assert not events(ev, "snapshot.corrupt")
    assert "pathlib.PosixPath" in log + "".join(str(e) for e in events(ev)), log[-4000:]
    assert list_snapshot_dirs(store) == [15, 10, 5]  # nothing deleted
