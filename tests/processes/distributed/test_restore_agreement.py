"""Two real ranks over gloo agree before anyone resumes (issue 9, cases 4 and 9):
a read error on one rank makes every rank raise (no fallback, no hang, no rank
resuming alone), and ranks that do not see rank 0's snapshots (node-local
storage on several nodes) all fail with one line, while a fresh run still starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from structlog.testing import capture_logs

from elastictrain.core import layout
from elastictrain.snapshot.durable.restore import load_newest
from elastictrain.storage import Store, open_store
from tests.fault_stores import FailingReads
from tests.planted import plant_snapshot
from tests.processes.distributed.test_snapshot_collectives import _group, _join

pytestmark = pytest.mark.distributed


def _save(store: Store, step: int) -> None:
    plant_snapshot(store, step, {"step": step, "w": torch.full((8,), float(step))}, 2)


def _attempt(store: Store, ctx: Any, mode: str) -> dict[str, Any]:
    with capture_logs() as logs:
        try:
            loaded = load_newest(store, ctx, mode)
            result: dict[str, Any] = {"step": None if loaded is None else loaded.step}
        except Exception as exc:
            result = {"raised": type(exc).__name__, "message": str(exc)}
    result["corrupt_logged"] = any(e["event"] == "snapshot.corrupt" for e in logs)
    return result


def _read_error_rank(rank: int, tmp: str, port: int) -> None:
    ctx = _group(rank, port)
    store = open_store(f"{tmp}/run")
    if rank == 0:
        _save(store, 5)
        _save(store, 10)
    ctx.barrier()
    # The reader that fails: rank 1 where every rank reads, rank 0 (the only reader)
    # in broadcast mode.
    failing = {"each": 1, "broadcast": 0}
    results = {mode: _attempt(FailingReads(store, match=layout.PAYLOAD)
                              if rank == failing[mode] else store, ctx, mode)
               for mode in ("each", "broadcast")}
    Path(f"{tmp}/read-error-{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_a_read_error_on_one_rank_fails_every_rank(tmp_path: Path) -> None:
    _join(tmp_path, _read_error_rank)
    results = [json.loads((tmp_path / f"read-error-{r}.json").read_text()) for r in (0, 1)]
    for mode, failing in (("each", 1), ("broadcast", 0)):
        for rank in (0, 1):
            got = results[rank][mode]
            assert not got["corrupt_logged"] and "step" not in got, (mode, rank, got)
            assert "step_000000000010" in got["message"], (mode, rank, got)
            if rank == failing:
                assert got["raised"] == "StorageTransientError", (mode, rank, got)
            else:
                assert got["raised"] == "StorageError", (mode, rank, got)
                assert "another rank could not read" in got["message"], (mode, rank, got)
    assert sorted(p.name for p in (tmp_path / "run" / "snapshots").iterdir()) == [
        "step_000000000005", "step_000000000010"]  # nothing deleted


def _node_local_rank(rank: int, tmp: str, port: int, with_snapshot: bool) -> None:
    ctx = _group(rank, port)
    ctx.local_rank = 0  # each rank a node of its own: its local rank 0 looks
    store = open_store(f"{tmp}/node{rank}/run")  # each "node" has its own disk
    if rank == 0 and with_snapshot:
        _save(store, 10)
    ctx.barrier()
    results = {mode: _attempt(store, ctx, mode) for mode in ("each", "broadcast")}
    Path(f"{tmp}/node-local-{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_node_local_storage_on_several_nodes_fails_on_every_rank(tmp_path: Path) -> None:
    _join(tmp_path, _node_local_rank, True)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"node-local-{rank}.json").read_text())
        for mode in ("each", "broadcast"):
            got = results[mode]
            assert got["raised"] == "ConfigError", (rank, mode, got)
            assert got["message"].startswith("rank 1 does not see snapshots under "), got
            assert "fix: use shared storage" in got["message"] and "\n" not in got["message"]
            assert not got["corrupt_logged"]


def test_a_fresh_run_on_node_local_storage_still_starts(tmp_path: Path) -> None:
    _join(tmp_path, _node_local_rank, False)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"node-local-{rank}.json").read_text())
        assert results == {m: {"step": None, "corrupt_logged": False}
                           for m in ("each", "broadcast")}
