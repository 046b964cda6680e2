"""Per-rank state in one process (``state=`` objects and ``rank_extras``): saved with the
rank's RNG states on the durable and the memory tier, restored after the RNG rule,
checked at save, refused at another world size unless the object can take it."""

from __future__ import annotations

import pathlib
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import elastictrain as et
from elastictrain.core.errors import ConfigError, ResumeMismatchError, UnsafeStateError
from elastictrain.snapshot.memory.peer_restore import receive_copy, send_copy
from elastictrain.snapshot.state.rank_state import RankState, saved_names
from elastictrain.storage import open_store
from elastictrain.worker.dist import DistContext
from tests.small_job import build, train
from tests.unit.snapshot.memory.test_peer_units import Wire, _both


class Counter:
    """A per-rank object: counts the steps it saw and draws from its own generator."""

    def __init__(self) -> None:
        self.seen = 0
        self.gen = torch.Generator().manual_seed(7)
        self.loaded: list[Any] = []

    def tick(self) -> None:
        self.seen += 1
        torch.rand(1, generator=self.gen)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "gen": self.gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded.append(state)
        self.seen = state["seen"]
        self.gen.set_state(state["gen"])


class Resizable(Counter):
    def load_state_dict_resized(self, state: dict[str, Any] | None, saved_world: int) -> None:
        self.loaded.append((state, saved_world))


def ctx(rank: int, world: int) -> DistContext:
    return DistContext(rank, world, 0, "gloo", torch.device("cpu"), False)


def counted(url: str, counter: Counter, until: int, **kw: Any) -> et.SnapshotManager:
    *parts, snap = build(url, state={"counter": counter}, **kw)
    while snap.step_count < until:  # the per-rank state moves with each step
        counter.tick()
        snap.rank_extras["last"] = snap.step_count + 1
        train(*parts, snap, until=snap.step_count + 1)
    return snap


def test_state_and_rank_extras_resume_at_the_saved_step(tmp_path: Path) -> None:
    ref = Counter()
    counted(str(tmp_path / "ref"), ref, 12).close()
    first = Counter()
    counted(str(tmp_path / "run"), first, 12, save_on_close=False).close()  # newest: 10
    again = Counter()
    *_, snap = build(str(tmp_path / "run"), state={"counter": again})
    assert snap.restore().from_step == 10
    assert again.seen == 10 and snap.rank_extras == {"last": 10}
    assert torch.rand(1, generator=again.gen).item() == pytest.approx(
        torch.rand(1, generator=_generator_after(10)).item())
    snap.close()


def _generator_after(draws: int) -> torch.Generator:
    gen = torch.Generator().manual_seed(7)
    torch.rand(draws, generator=gen)
    return gen


def test_the_memory_tier_holds_the_state_too(tmp_path: Path) -> None:
    counter = Counter()
    mem = {"memory_every": 1, "memory_dir": str(tmp_path / "mem")}
    # Killed once its last memory snapshot committed: no close().
    counted(str(tmp_path / "run"), counter, 7, save_on_close=False, **mem).wait()
    again = Counter()
    *_, snap = build(str(tmp_path / "run"), state={"counter": again}, **mem)
    info = snap.restore()
    assert (info.from_step, info.tier) == (7, "memory")
    assert again.seen == 7 and snap.rank_extras == {"last": 7}
    snap.close()


@pytest.mark.parametrize("tier", ["durable", "memory"])
def test_a_sharded_save_holds_the_state_too(tmp_path: Path, tier: str) -> None:
    """Through DCP: in the training state object beside the shards (``train-<token>.pt``)."""
    mem = {"memory_every": 1, "memory_dir": str(tmp_path / "mem")} if tier == "memory" else {}
    policy = {"sharded": True, "every_steps": 3, **mem}
    counted(str(tmp_path / "run"), Counter(), 7, save_on_close=False, **policy).wait()
    again = Counter()
    *_, snap = build(str(tmp_path / "run"), state={"counter": again}, **policy)
    info = snap.restore()
    step = 7 if tier == "memory" else 6
    assert (info.from_step, info.tier) == (step, tier)
    assert again.seen == step and snap.rank_extras == {"last": step}
    snap.close()


def test_a_peer_copy_holds_the_state_too(tmp_path: Path) -> None:
    """A node's memory snapshot, copied to another node's memory, restores the state."""
    mem = {"memory_every": 1, "memory_dir": str(tmp_path / "mem")}
    counted(str(tmp_path / "run"), Counter(), 7, save_on_close=False, **mem).wait()
    wire = Wire()
    (tmp_path / "new").mkdir(mode=0o700)  # a memory directory is private
    copied = open_store(str(tmp_path / "new"))
    assert _both(lambda: send_copy(wire.end(0), open_store(str(tmp_path / "mem")), 7, 1),
                 lambda: receive_copy(wire.end(1), copied, 7, 0)) is True
    # The other node's memory directory of this run, holding only the copy.
    shutil.copy(tmp_path / "mem" / "IDENTITY.json", tmp_path / "new" / "IDENTITY.json")
    shutil.rmtree(tmp_path / "mem")
    again = Counter()
    *_, snap = build(str(tmp_path / "run"), state={"counter": again}, memory_every=1,
                     memory_dir=str(tmp_path / "new"))
    info = snap.restore()
    assert (info.from_step, info.tier) == (7, "memory")
    assert again.seen == 7 and snap.rank_extras == {"last": 7}
    snap.close()


def test_an_unsafe_state_is_refused_at_save_naming_the_object(tmp_path: Path) -> None:
    class Unsafe(Counter):
        def state_dict(self) -> dict[str, Any]:
            return {"where": pathlib.PurePosixPath("/data")}

    *parts, snap = build(str(tmp_path), state={"loader": Unsafe()}, every_steps=2)
    with pytest.raises(UnsafeStateError) as raised:
        train(*parts, snap, until=2)
    message = str(raised.value)
    assert "state['loader']['where']" in message and "PurePosixPath" in message
    assert "\n" not in message


def test_an_unsafe_rank_extra_is_refused_at_save(tmp_path: Path) -> None:
    *parts, snap = build(str(tmp_path), every_steps=2)
    snap.rank_extras["path"] = pathlib.PurePosixPath("/x")
    with pytest.raises(UnsafeStateError, match=r"rank_extras\['path'\]"):
        train(*parts, snap, until=2)


def test_an_object_without_state_dict_is_refused_at_construction() -> None:
    with pytest.raises(ConfigError, match=r"state\['loader'\] is a list"):
        RankState({"loader": []})


def _saved_at_world_1(tmp_path: Path, counter: Counter) -> str:
    url = str(tmp_path / "run")
    model = torch.nn.Linear(3, 1)
    snap = et.SnapshotManager(url, model=model, state={"counter": counter}, every_steps=2)
    for _ in range(2):
        counter.tick()
        snap.step()
    snap.close()
    return url


def test_another_world_size_is_refused_for_per_rank_state(tmp_path: Path) -> None:
    url = _saved_at_world_1(tmp_path, Counter())
    model, counter = torch.nn.Linear(3, 1), Counter()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    snap = et.SnapshotManager(url, model=model, state={"counter": counter}, ctx=ctx(0, 2))
    with pytest.raises(ResumeMismatchError) as raised:
        snap.restore()
    message = str(raised.value)
    assert "\n" not in message and "state['counter']" in message
    assert "world size 1" in message and "world size 2" in message and "fix:" in message
    # Refused before anything was loaded.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert counter.loaded == [] and counter.seen == 0


def test_an_object_that_can_be_resized_is_handed_its_rank_state(tmp_path: Path) -> None:
    url = _saved_at_world_1(tmp_path, Counter())
    resizable = Resizable()
    snap = et.SnapshotManager(url, model=torch.nn.Linear(3, 1), state={"counter": resizable},
                              ctx=ctx(0, 2))
    assert snap.restore().from_step == 2
    ((state, saved_world),) = resizable.loaded
    assert (state["seen"], saved_world) == (2, 1)
    # A rank that did not exist at the save is handed None.
    new_rank = Resizable()
    saved = {"objects": ["counter"], "extras": False}
    RankState({"counter": new_rank}).apply(None, saved, saved_world=1, world_size=2)
    assert new_rank.loaded == [(None, 1)]
    # Nothing is handed over from a snapshot that holds no state of the object.
    unsaved = Resizable()
    RankState({"counter": unsaved}).apply(None, None, saved_world=1, world_size=2)
    assert unsaved.loaded == []


def test_rank_extras_at_another_world_size_are_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    snap = et.SnapshotManager(url, model=torch.nn.Linear(3, 1), every_steps=1)
    snap.rank_extras["mine"] = 1
    snap.step()
    snap.close()
    again = et.SnapshotManager(url, model=torch.nn.Linear(3, 1), ctx=ctx(0, 3))
    with pytest.raises(ResumeMismatchError, match=r"rank_extras.*world size 1.*world size 3"):
        again.restore()


def test_a_snapshot_without_per_rank_state_still_loads(tmp_path: Path) -> None:
    *parts, snap = build(str(tmp_path))
    train(*parts, snap, until=5)
    snap.close()
    counter = Counter()
    *_, again = build(str(tmp_path), state={"counter": counter})
    assert again.restore().from_step == 5
    assert counter.seen == 0 and counter.loaded == [] and again.rank_extras == {}
    again.close()


def test_a_job_without_per_rank_state_saves_what_it_always_did() -> None:
    assert saved_names([{"torch": 1}, {"torch": 2}]) is None
    entries = [{"rank_state": {"objects": {"a": {}}, "extras": {}}},
               {"rank_state": {"objects": {"a": {}}, "extras": {"x": 1}}}]
    assert saved_names(entries) == {"objects": ["a"], "extras": True}
