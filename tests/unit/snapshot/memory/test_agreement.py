"""The node-memory tier in one process: the agreement rule, restore from memory when
it is newer, fallback to durable storage when memory is lost, older, corrupt,
unreadable or on another step on a peer, stale copies dropped, removal at close."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.contextvars import merge_contextvars
from structlog.testing import capture_logs

from elastictrain.core import layout
from elastictrain.core.errors import ConfigError, StorageError
from elastictrain.snapshot.durable.restore import LoadedSnapshot, load_newest
from elastictrain.snapshot.format.reader import list_snapshot_dirs, read_manifest
from elastictrain.snapshot.memory import memory
from elastictrain.snapshot.memory.memory_choice import Held
from elastictrain.snapshot.memory.memory_load import load_memory
from elastictrain.snapshot.memory.peer_restore import PeerCopies
from elastictrain.storage import Store, open_store
from elastictrain.worker.dist import DistContext
from tests.fault_stores import FailingReads
from tests.small_job import build, train


def _with_memory(store: Store, ctx: DistContext, memory_store: Store,
                 peers: PeerCopies | None = None, mode: str = "auto") -> LoadedSnapshot | None:
    """A restore that asks the node-memory tier first, as the manager composes it."""
    return load_newest(store, ctx, mode,
                       memory_first=functools.partial(load_memory, memory_store, ctx, peers))


def _run(tmp_path: Path, until: int, mem: str = "mem") -> Any:
    """Train to ``until`` with a memory snapshot every step and a durable one every 5,
    then stop without close() (a crash: memory is kept)."""
    parts = build(str(tmp_path / "run"), memory_every=1, memory_dir=str(tmp_path / mem))
    train(*parts, until=until)
    parts[4].wait()
    return parts


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_newer_memory_snapshot_is_restored(tmp_path: Path) -> None:
    crashed = _run(tmp_path, 7)  # durable 5, memory 7
    assert list_snapshot_dirs(open_store(str(tmp_path / "mem")))[0] == 7
    parts = build(str(tmp_path / "run"), memory_every=1, memory_dir=str(tmp_path / "mem"))
    with capture_logs() as logs:
        info = parts[4].restore()
    assert (info.from_step, info.tier) == (7, "memory")
    assert all(torch.equal(a, b) for a, b in zip(_params(parts[0]), _params(crashed[0]),
                                                 strict=True))
    loaded = [e for e in logs if e["event"] in ("snapshot.loaded", "resume")]
    assert [e["tier"] for e in loaded] == ["memory", "memory"]


def test_lost_memory_falls_back_to_durable(tmp_path: Path) -> None:
    _run(tmp_path, 7)
    parts = build(str(tmp_path / "run"), memory_every=1, memory_dir=str(tmp_path / "new"))
    with capture_logs() as logs:
        info = parts[4].restore()
    assert (info.from_step, info.tier) == (5, "durable")
    (skipped,) = [e for e in logs if e["event"] == "snapshot.memory_skipped"]
    assert (skipped["reason"], skipped["durable_step"]) == ("no memory snapshot", 5)


def test_memory_older_than_durable_is_not_used(tmp_path: Path) -> None:
    _run(tmp_path, 10)  # step 10 goes to durable only: memory holds 9
    parts = build(str(tmp_path / "run"), memory_every=1, memory_dir=str(tmp_path / "mem"))
    with capture_logs() as logs:
        info = parts[4].restore()
    assert (info.from_step, info.tier) == (10, "durable")
    (skipped,) = [e for e in logs if e["event"] == "snapshot.memory_skipped"]
    assert skipped["reason"] == "not newer than the durable snapshot"


def test_corrupt_memory_falls_back_and_is_dropped(tmp_path: Path) -> None:
    _run(tmp_path, 7)
    payload = tmp_path / "mem" / layout.step_dir(7) / layout.PAYLOAD
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))
    parts = build(str(tmp_path / "run"), memory_every=1, memory_dir=str(tmp_path / "mem"))
    with capture_logs() as logs:
        info = parts[4].restore()
    assert (info.from_step, info.tier) == (5, "durable")
    (skipped,) = [e for e in logs if e["event"] == "snapshot.memory_skipped"]
    assert skipped["reason"] == "corrupt on some rank"
    # Step 7 belongs to the abandoned timeline: a later restart must never see it.
    assert list_snapshot_dirs(open_store(str(tmp_path / "mem"))) == []
    train(*parts, until=6)
    parts[4].wait()
    again = build(str(tmp_path / "run"), memory_every=1, memory_dir=str(tmp_path / "mem"))
    assert again[4].restore().from_step == 6


def test_memory_read_error_falls_back_to_durable(tmp_path: Path) -> None:
    _run(tmp_path, 7)
    ctx = DistContext(0, 1, 0, "gloo", torch.device("cpu"), False)
    failing = FailingReads(open_store(str(tmp_path / "mem")), match=layout.PAYLOAD)
    with capture_logs() as logs:
        loaded = _with_memory(open_store(str(tmp_path / "run")), ctx, failing)
    assert loaded is not None and (loaded.step, loaded.tier) == (5, "durable")
    assert failing.failed == 1
    (skipped,) = [e for e in logs if e["event"] == "snapshot.memory_skipped"]
    assert skipped["reason"] == "failed on some rank" and "SlowDown" in skipped["error"]


class _PeerCtx(DistContext):
    """One process standing for two nodes: the all-reduces also see a peer's values,
    the all-gather the peer's newest memory snapshot (None: the same as this one's)."""

    def __init__(self, peer: list[list[int]], held: Held | None = None) -> None:
        super().__init__(0, 2, 0, "gloo", torch.device("cpu"), False)
        self.peer, self.held = peer, held

    def all_reduce_max(self, values: list[int]) -> list[int]:
        theirs = self.peer.pop(0) if self.peer else values  # later: the peer agrees
        return [max(a, b) for a, b in zip(values, theirs, strict=True)]

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj, obj if self.held is None else self.held]


def _held_here(tmp_path: Path) -> Held:
    return Held.of(read_manifest(open_store(str(tmp_path / "mem")), 7))


@pytest.mark.parametrize("other", ["step 6", "same step, another snapshot",
                                   "same step, an earlier attempt"])
def test_a_peer_node_holding_another_snapshot_means_durable(tmp_path: Path, other: str) -> None:
    """Without copies across nodes, every node must hold the very same snapshot: never
    each node its own (two ranks would train on from different states)."""
    _run(tmp_path, 7)
    here = _held_here(tmp_path)
    peer = {"step 6": Held(6, here.attempt, "x"),
            "same step, another snapshot": Held(7, here.attempt, "x"),
            "same step, an earlier attempt": Held(7, here.attempt - 1, "x")}[other]
    with capture_logs() as logs:
        loaded = _with_memory(open_store(str(tmp_path / "run")), _PeerCtx([], peer),
                              open_store(str(tmp_path / "mem")), mode="each")
    assert loaded is not None and (loaded.step, loaded.tier) == (5, "durable")
    (skipped,) = [e for e in logs if e["event"] == "snapshot.memory_skipped"]
    expected = ("2 different snapshots of step 7" if other == "same step, another snapshot"
                else "no copy may cross nodes")
    assert expected in skipped["reason"]


def test_a_peer_that_fails_to_verify_means_durable(tmp_path: Path) -> None:
    _run(tmp_path, 7)
    ctx = _PeerCtx([[1, 0]])  # same snapshot everywhere, corrupt on the peer
    loaded = _with_memory(open_store(str(tmp_path / "run")), ctx,
                          open_store(str(tmp_path / "mem")), mode="each")
    assert loaded is not None and (loaded.step, loaded.tier) == (5, "durable")


def test_close_removes_the_memory_tier(tmp_path: Path) -> None:
    parts = _run(tmp_path, 7)
    assert (tmp_path / "mem").is_dir()
    with capture_logs() as logs:
        parts[4].close()
    assert not (tmp_path / "mem").exists()
    assert [e["event"] for e in logs].count("snapshot.memory_removed") == 1


def test_events_name_their_tier(tmp_path: Path) -> None:
    # The persister logs in the saver's context: the tier is bound there.
    with capture_logs(processors=[merge_contextvars]) as logs:
        parts = _run(tmp_path, 6)
    tiers = {(e["snapshot_step"], e["tier"]) for e in logs
             if e["event"] in ("snapshot.committed", "snapshot.staged")}
    assert (5, "durable") in tiers and (6, "memory") in tiers and (5, "memory") not in tiers
    parts[4].close()


def test_sharded_model_restores_its_memory_snapshot(tmp_path: Path) -> None:
    """One process, sharded saver: a memory snapshot every step is this node's whole
    step (its manifest, HELD.json, every part); the restart resumes it, bit-exact."""
    url, mem = str(tmp_path / "run"), str(tmp_path / "mem")
    ref = build(url + "-ref", sharded=True)
    ref_losses = train(*ref, until=9)
    ref[4].close()
    crashed = build(url, sharded=True, memory_every=1, memory_dir=mem)
    train(*crashed, until=7)  # durable 5, memory 6 and 7; no close(): a crash
    crashed[4].wait()
    assert list_snapshot_dirs(open_store(mem)) == [7]  # keep=1 in memory
    parts = build(url, sharded=True, memory_every=1, memory_dir=mem)
    with capture_logs() as logs:
        info = parts[4].restore()
    assert (info.from_step, info.tier) == (7, "memory")
    (loaded,) = [e for e in logs if e["event"] == "snapshot.loaded"]
    assert (loaded["tier"], loaded["peer_rank"]) == ("memory", None)
    assert train(*parts, until=9) == ref_losses[7:]
    for got, want in zip(_params(parts[0]), _params(ref[0]), strict=True):
        assert torch.equal(got, want)
    parts[4].close()
    assert not Path(mem).exists()


def test_remote_memory_dir_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"snapshot.memory_dir='s3://b/x' .*fix:"):
        build(str(tmp_path / "run"), memory_every=1, memory_dir="s3://b/x")


def test_default_memory_dir_is_per_user_and_storage_in_shm(tmp_path: Path) -> None:
    from elastictrain.core.config import SnapshotConfig

    config = SnapshotConfig(memory_every=1)
    path = memory.memory_dir(config, str(tmp_path / "a"))
    assert path.parent == Path(f"/dev/shm/elastictrain-{os.geteuid()}")
    assert path == memory.memory_dir(config, f"file://{tmp_path}/x/../a")  # one storage
    assert path != memory.memory_dir(config, str(tmp_path / "b"))


class _FailingCopies:
    """Peers that chose this node's step 4 for a node lacking it, whose copy failed."""

    def agree(self, held: Held, can_receive: bool, durable: Any) -> Any:
        from elastictrain.snapshot.memory.memory_choice import Choice
        return Choice(held.step, None, {1: 0})

    def fetch(self, choice: Any, store: Any) -> bool:
        return False

    def source_rank(self, choice: Any) -> None:
        return None


def test_a_failed_copy_before_any_durable_snapshot_keeps_the_holders_copy(
        tmp_path: Path) -> None:
    """No durable snapshot yet: a fresh start would drop the job's only snapshot with the
    stale ones. The attempt fails instead (torchrun retries) and the copy stays."""
    parts = build(str(tmp_path / "run"), memory_every=1, memory_dir=str(tmp_path / "mem"))
    train(*parts, until=4)  # the first durable snapshot is at step 5
    parts[4].wait()
    ctx = DistContext(0, 1, 0, "gloo", torch.device("cpu"), False)
    memory_store = open_store(str(tmp_path / "mem"))
    with pytest.raises(StorageError, match="could not be copied"):
        _with_memory(open_store(str(tmp_path / "run")), ctx, memory_store,
                     _FailingCopies(), mode="each")  # type: ignore[arg-type]
    assert 4 in list_snapshot_dirs(memory_store)  # verified, kept
