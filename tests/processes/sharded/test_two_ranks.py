"""Two real FSDP2 ranks over gloo: when one rank's part of the newest snapshot is
missing or corrupt, both ranks fall back to the previous snapshot together; a
rank restoring at the same world size reads its shard, not the whole state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from structlog.testing import capture_logs
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from elastictrain.core import layout
from elastictrain.snapshot.format.reader import read_manifest
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.storage import open_store
from elastictrain.worker.dist import DistContext
from tests.processes.distributed.test_snapshot_collectives import _group, _join

pytestmark = pytest.mark.distributed


def _manager(ctx: DistContext, url: str) -> tuple[nn.Module, Any, SnapshotManager]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256))
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt, SnapshotManager(url, model=model, optimizer=opt, ctx=ctx, every_steps=2)


def _damage(url: str, how: str) -> None:
    """Rank 1's part of the snapshot of step 4: deleted, or one byte of an item flipped."""
    store = open_store(url)
    entry = next(o for o in read_manifest(store, 4).objects if o.rank == 1)
    path = f"{layout.step_dir(4)}/{entry.name}"
    if how == "missing":
        store.delete(path)
        return
    data = bytearray(store.read_bytes(path))
    assert entry.items
    data[entry.items[0].offset] ^= 0xFF
    store.delete(path)
    store.write_bytes(path, bytes(data))


def _rank(rank: int, tmp: str, port: int, how: str) -> None:
    ctx = _group(rank, port)
    url = str(Path(tmp) / "store")
    model, opt, snap = _manager(ctx, url)
    for _ in range(4):  # snapshots at steps 2 and 4
        model(torch.randn(8, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        snap.step()
    snap.close()
    dist.barrier()
    if rank == 0 and how != "none":
        _damage(url, how)
    dist.barrier()
    _, _, again = _manager(ctx, url)
    with capture_logs() as logs:
        info = again.restore()
    again.close()
    result = {"from_step": info.from_step,
              "corrupt": [e["reason"] for e in logs if e["event"] == "snapshot.corrupt"],
              "bytes_read": [e["bytes_read"] for e in logs if e["event"] == "snapshot.discovered"]}
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _results(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("how", ["missing", "corrupt"])
def test_one_rank_part_damaged_both_fall_back(tmp_path: Path, how: str) -> None:
    _join(tmp_path, _rank, how)
    results = _results(tmp_path)
    assert [r["from_step"] for r in results] == [2, 2]
    expected = "rank 1 is missing" if how == "missing" else "rank 1: "
    assert all(expected in r["corrupt"][0] for r in results), results
    if how == "corrupt":  # only rank 1 read the bad item; rank 0 learned it through DCP
        assert all("rank00001-" in r["corrupt"][0] and "item at offset 0" in r["corrupt"][0]
                   for r in results)


def test_each_rank_reads_about_its_shard(tmp_path: Path) -> None:
    _join(tmp_path, _rank, "none")
    store = open_store(str(tmp_path / "store"))
    manifest = read_manifest(store, 4)
    parts = {o.rank: o.size_bytes for o in manifest.objects if o.rank is not None and o.items}
    assert sorted(parts) == [0, 1]
    total = sum(parts.values())
    for result in _results(tmp_path):
        assert result["from_step"] == 4
        # Its half of every tensor, plus the few small replicated items (optimizer
        # hyperparameters, step counters) that DCP stored once, in either rank's part.
        (read,) = result["bytes_read"]
        assert 0.45 * total < read < 0.55 * total, (read, total)


def _ddp_rank(rank: int, tmp: str, port: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = _group(rank, port)
    url = str(Path(tmp) / "store")

    def striped() -> tuple[nn.Module, Any, SnapshotManager]:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256)))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        return model, opt, SnapshotManager(url, model=model, optimizer=opt, ctx=ctx,
                                           every_steps=2, sharded=True)

    model, opt, snap = striped()
    for _ in range(2):
        model(torch.randn(8, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        snap.step()
    snap.close()
    again_model, _, again = striped()
    info = again.restore()
    again.close()
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), again_model.parameters(),
                                                 strict=True))
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps({"from_step": info.from_step,
                                                            "same": same}))
    dist.destroy_process_group()


def test_replicated_ddp_state_is_striped_over_ranks(tmp_path: Path) -> None:
    """sharded=True with DDP: DCP writes each replicated tensor once, on the rank with
    the fewest planned bytes, so each rank writes about half; restore is exact."""
    _join(tmp_path, _ddp_rank)
    assert _results(tmp_path) == [{"from_step": 2, "same": True}] * 2
    manifest = read_manifest(open_store(str(tmp_path / "store")), 2)
    parts = [o.size_bytes for o in manifest.objects if o.items]
    assert len(parts) == 2
    assert 0.35 < parts[0] / sum(parts) < 0.65, parts
