"""Two real ranks over gloo: replicas that hold different states after a restore stop
the run on every rank (``ReplicasDiverged``, exit 78) instead of training on; replicas
that end apart are reported at ``close()`` (``run.replicas_diverged``,
``replicas_equal: false``) (snapshot/state/replica_check.py). The fault: one rank's parameters
changed behind the manager's back (as a replica rebuilt wrong would be)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from structlog.testing import capture_logs

from elastictrain.core.errors import EXIT_FATAL, ReplicasDiverged
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.snapshot.state.training_state import TrainingState
from tests.processes.distributed.test_snapshot_collectives import _group, _join

pytestmark = pytest.mark.distributed


def _manager(tmp: str, ctx: Any) -> SnapshotManager:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return SnapshotManager(f"{tmp}/run", model=model, optimizer=opt, ctx=ctx, every_steps=2)


def _train(snap: SnapshotManager, steps: int) -> None:
    for _ in range(steps):
        snap.model(torch.ones(2, 4)).sum().backward()
        snap.optimizer.step()
        snap.optimizer.zero_grad()
        snap.step()


def _outcome(call: Any) -> dict[str, Any]:
    try:
        call()
        return {"raised": None}
    except ReplicasDiverged as exc:
        return {"raised": "ReplicasDiverged", "message": str(exc), "code": exc.exit_code}


def _rank(rank: int, tmp: str, port: int, when: str) -> None:
    ctx = _group(rank, port)
    snap = _manager(tmp, ctx)
    snap.restore()
    _train(snap, 2)  # a durable snapshot of step 2
    snap.wait()
    result: dict[str, Any] = {}
    if when == "restore":
        again = _manager(tmp, ctx)
        if rank == 1:  # rank 1 applies the snapshot wrong
            apply = TrainingState.apply

            def wrong(self: TrainingState, payload: dict[str, Any]) -> str:
                rule = apply(self, payload)
                with torch.no_grad():
                    next(self.model.parameters()).add_(1e-6)
                return rule

            TrainingState.apply = wrong  # type: ignore[method-assign]
        result = _outcome(again.restore)
    else:
        if rank == 1:
            with torch.no_grad():
                next(snap.model.parameters()).mul_(1.0000001)
        with capture_logs() as logs:
            result = _outcome(snap.close)
        result["events"] = [{k: e.get(k) for k in ("event", "replicas_equal", "digests")}
                            for e in logs if e["event"] in ("run.replicas_diverged",
                                                            "run.finished")]
    Path(f"{tmp}/{when}-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_replicas_apart_after_a_restore_stop_every_rank(tmp_path: Path) -> None:
    _join(tmp_path, _rank, "restore")
    results = [json.loads((tmp_path / f"restore-{r}.json").read_text()) for r in (0, 1)]
    for result in results:
        assert result["raised"] == "ReplicasDiverged", results
        assert result["code"] == EXIT_FATAL
        assert "ranks [0]" in result["message"] and "ranks [1]" in result["message"]


def test_replicas_apart_at_the_end_are_reported(tmp_path: Path) -> None:
    _join(tmp_path, _rank, "close")
    r0, r1 = (json.loads((tmp_path / f"close-{r}.json").read_text()) for r in (0, 1))
    assert r0["raised"] is None and r1["raised"] is None  # the end stands
    diverged, finished = r0["events"]
    assert diverged["event"] == "run.replicas_diverged"
    assert "ranks [0]" in diverged["digests"] and "ranks [1]" in diverged["digests"]
    assert (finished["event"], finished["replicas_equal"]) == ("run.finished", False)
    assert r1["events"] == []  # rank 0 reports


def _equal_rank(rank: int, tmp: str, port: int) -> None:
    ctx = _group(rank, port)
    snap = _manager(tmp, ctx)
    snap.restore()
    _train(snap, 3)
    with capture_logs() as logs:
        snap.close()
    equal = [e["replicas_equal"] for e in logs if e["event"] == "run.finished"]
    again = _manager(tmp, ctx)
    info = again.restore()
    Path(f"{tmp}/equal-{rank}.json").write_text(json.dumps({"from": info.from_step,
                                                            "equal": equal}))
    dist.destroy_process_group()


def test_equal_replicas_restore_and_end(tmp_path: Path) -> None:
    _join(tmp_path, _equal_rank)
    assert [json.loads((tmp_path / f"equal-{r}.json").read_text()) for r in (0, 1)] == \
        [{"from": 3, "equal": [True]}, {"from": 3, "equal": []}]  # close() saved step 3
