"""DDP's rebuilt bucket layout, recorded with a snapshot and given back to a fresh DDP
model at restore (worker/bucket_layout.py): the restored model reduces its first step in
the buckets the uninterrupted process had then, not in DDP's first-step single bucket.
Bit-exactness at 3, 4 and 8 ranks: tests/processes/distributed/test_exact_resume.py."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs
from torch.nn.parallel import DistributedDataParallel

from elastictrain.core import layout
from elastictrain.snapshot.format.reader import read_manifest
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.storage import open_store
from elastictrain.worker.bucket_layout import (
    BucketLayout,
    find_ddp,
    parse,
    rebuilt_layout,
    why_not_installable,
)
from elastictrain.worker.exact_reduce import fixed_order_allreduce

pytestmark = pytest.mark.usefixtures("one_rank_group")


def _ddp(seed: int = 0) -> DistributedDataParallel:
    """Four layers, buckets capped so that DDP rebuilds them into several."""
    torch.manual_seed(seed)
    inner = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    return DistributedDataParallel(inner, bucket_cap_mb=0.02)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, snap: SnapshotManager | None,
           steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 64)).pow(2).mean().backward()
        opt.step()
        if snap is not None:
            snap.step()


def _bucket_sizes(model: DistributedDataParallel) -> list[int]:
    return [b.buffer().numel() for b in model.reducer._get_zeros_like_grad_buckets()]


def _saved_layout(root: Path, step: int) -> Any:
    store = open_store(str(root))
    [entry] = read_manifest(store, step).objects
    payload = torch.load(io.BytesIO(store.read_bytes(f"{layout.step_dir(step)}/{entry.name}")),
                         weights_only=True)
    return payload.get("ddp_buckets")


def test_ddp_text_form_is_parsed_into_buckets() -> None:
    assert parse("7 6 5 4, 3 2 1 0") == [[7, 6, 5, 4], [3, 2, 1, 0]]
    assert parse("1 0") == [[1, 0]]


def test_a_snapshot_records_the_rebuilt_layout_and_a_restore_gives_it_back(
        tmp_path: Path) -> None:
    model = _ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fresh_sizes = _bucket_sizes(model)
    assert len(fresh_sizes) == 1  # DDP's first step: every parameter in one bucket
    snap = SnapshotManager(str(tmp_path / "run"), model=model, optimizer=opt, every_steps=3)
    _train(model, opt, snap, 3)
    snap.close()
    recorded = _saved_layout(tmp_path / "run", 3)
    assert recorded == rebuilt_layout(model) and len(recorded) > 1
    assert sorted(i for bucket in recorded for i in bucket) == list(range(8))
    rebuilt_sizes = _bucket_sizes(model)

    restarted = _ddp(seed=1)
    restarted_opt = torch.optim.SGD(restarted.parameters(), lr=0.1)
    assert _bucket_sizes(restarted) == fresh_sizes
    with capture_logs() as logs:
        snap2 = SnapshotManager(str(tmp_path / "run"), model=restarted,
                                optimizer=restarted_opt, every_steps=3)
        assert snap2.restore().from_step == 3
    said = [e for e in logs if e["event"] == "dist.bucket_layout"]
    assert said and said[0]["installed"] is True and said[0]["reason"] is None
    assert _bucket_sizes(restarted) == rebuilt_sizes  # before its first step
    # The restored process's first snapshot, taken before DDP rebuilt anything in it,
    # records the layout it was given, so a second restart from it is exact too.
    _train(restarted, restarted_opt, snap2, 3)
    snap2.close()
    assert _saved_layout(tmp_path / "run", 6) == recorded


def test_the_first_steps_snapshot_records_no_layout_and_restores_as_before(
        tmp_path: Path) -> None:
    model = _ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = SnapshotManager(str(tmp_path / "run"), model=model, optimizer=opt, every_steps=1)
    _train(model, opt, snap, 1)  # DDP rebuilds its buckets at the next forward pass
    snap.close()
    assert _saved_layout(tmp_path / "run", 1) is None
    restarted = _ddp()
    with capture_logs() as logs:
        SnapshotManager(str(tmp_path / "run"), model=restarted,
                        optimizer=torch.optim.SGD(restarted.parameters(), lr=0.1)).restore()
    assert not [e for e in logs if e["event"] == "dist.bucket_layout"]
    assert len(_bucket_sizes(restarted)) == 1


def test_a_layout_that_does_not_fit_the_model_is_refused() -> None:
    model = _ddp()
    assert why_not_installable(model, [[7, 6, 5, 4], [3, 2, 1, 0]]) is None
    assert "covers 7 parameters" in str(why_not_installable(model, [[6, 5, 4], [3, 2, 1, 0]]))
    assert "covers 8 parameters" in str(why_not_installable(model, [[7, 7, 5, 4], [3, 2, 1, 0]]))
    assert "not a list of buckets" in str(why_not_installable(model, "7 6 5 4"))
    assert "not a list of buckets" in str(why_not_installable(model, [[7, 6, 5, 4, 3, 2, 1, 0],
                                                                       []]))
    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).double())
    assert "mixes dtypes" in str(why_not_installable(DistributedDataParallel(mixed),
                                                     [[3, 2, 1, 0]]))


def test_a_model_with_a_comm_hook_keeps_its_reducer(tmp_path: Path) -> None:
    model = _ddp()
    model.register_comm_hook(None, fixed_order_allreduce)
    assert "comm hook" in str(why_not_installable(model, [[7, 6, 5, 4], [3, 2, 1, 0]]))
    buckets = BucketLayout(model)
    with capture_logs() as logs:
        buckets.restore([[7, 6, 5, 4], [3, 2, 1, 0]])
    assert logs[0]["installed"] is False and "comm hook" in logs[0]["reason"]
    assert len(_bucket_sizes(model)) == 1


def test_only_ddp_models_have_a_layout() -> None:
    plain = torch.nn.Linear(4, 4)
    assert find_ddp(plain) is None and BucketLayout(plain).for_snapshot() is None
    model = _ddp()
    compiled = torch.compile(model, backend="eager")
    assert find_ddp(compiled) is model  # type: ignore[arg-type]


def test_a_ddp_without_the_known_reducer_rebuild_is_left_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _ddp()

    def other_helper(parameters: Any, expect_sparse_gradient: Any) -> None:
        raise AssertionError("must not be called")

    monkeypatch.setattr(model, "_ddp_init_helper", other_helper)
    assert "does not rebuild its reducer" in str(why_not_installable(model, [[7, 6, 5, 4],
                                                                              [3, 2, 1, 0]]))
    with capture_logs() as logs:
        BucketLayout(model).restore([[7, 6, 5, 4], [3, 2, 1, 0]])
    assert logs[0]["installed"] is False
