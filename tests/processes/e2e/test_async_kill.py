"""Under real torchrun: SIGKILL the writer while its background persist is in flight.

The persist of step 20 stalls mid-payload (a test storage wrapper, first attempt
only); once rank 0 has logged ``snapshot.staged`` for step 20 and the write has
started, rank 0 is SIGKILLed by PID. Its persister process must die with it and
never commit; torchrun restarts both ranks, which resume from step 10.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from elastictrain.core import layout
from elastictrain.snapshot.format.reader import list_snapshot_dirs, verify_snapshot
from elastictrain.storage import open_store
from tests.fault_stores import read_journal
from tests.helpers import REPO, TRAIN_JOB, events, pid_alive, started, wait_for

pytestmark = pytest.mark.distributed


def _one(events_dir: Path, name: str, **match: object) -> dict[str, object]:
    found = [e for e in events(events_dir, name) if all(e.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (name, match, found)
    return found[0]


def test_kill_during_background_persist_commits_nothing(tmp_path: Path) -> None:
    root, journal, gate, ev = tmp_path / "run", tmp_path / "journal", tmp_path / "gate", \
        tmp_path / "ev"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--max-restarts=1", "--monitor-interval=0.1", "--rdzv-backend=c10d",
           "--rdzv-endpoint=127.0.0.1:0", f"--log-dir={tmp_path / 'logs'}",
           str(TRAIN_JOB), str(root), "30", "--every=10",
           "--persister=process", "--width=32", "--batch=8", "--optimizer=adamw",
           "--store", "gated", str(journal), str(gate)]
    with started(cmd, tmp_path, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                 ELASTICTRAIN_LOG__EVENTS_DIR=str(ev), PYTHONPATH=str(REPO)) as proc:
        wait_for(lambda: [e for e in events(ev, "snapshot.staged") if e["snapshot_step"] == 20],
                 180, "rank 0 to stage step 20")
        wait_for(lambda: any(line.startswith("start 20") for line in read_journal(journal)),
                 60, "the persist of step 20 to start writing")
        helper = int(_one(ev, "snapshot.persister_started", restart_count=0)["pid"])
        worker = int(_one(ev, "worker.start", restart_count=0, rank=0)["pid"])
        assert f"pid={helper}" in read_journal(journal)[-1] and pid_alive(helper)
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: not pid_alive(helper), 30, "the persister to die with its worker")
        assert proc.wait(timeout=240) == 0, (tmp_path / "proc.log").read_text()[-3000:]
    assert "end 20" not in read_journal(journal)  # the stalled write never finished
    resumes = [e for e in events(ev, "resume") if e["restart_count"] == 1]
    assert sorted(e["from_step"] for e in resumes) == [10, 10]  # 20 was never committed
    committed = [(e["restart_count"], e["snapshot_step"]) for e in events(ev, "snapshot.committed")]
    assert committed == [(0, 10), (1, 20), (1, 30)]
    store = open_store(str(root))
    assert list_snapshot_dirs(store) == [30, 20, 10]
    for step in (10, 20, 30):
        verify_snapshot(store, step)
    assert not [n for n in os.listdir(root / layout.SNAPSHOTS) if layout.is_partial(n)]
