"""Restore reads a local payload straight into the model's own tensors.

The model's memory is reused (no fresh copy, nothing for ``load_state_dict`` to
copy); tensors that share saved bytes with anything else go through fresh memory
as before; a snapshot that fails its checksum after its bytes landed in the model
is followed by an older one that overwrites them all, and when none verifies the
process stops (``RestoreOverwrote``) instead of starting fresh from bytes it
never verified. A resume refused on the snapshot's structure leaves the model as
it was."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

import elastictrain as et
from elastictrain.core import layout
from elastictrain.core.errors import EXIT_FATAL, RestoreOverwrote, ResumeMismatchError
from elastictrain.snapshot.format import onepass
from elastictrain.snapshot.format.reader import list_snapshot_dirs, verify_snapshot
from elastictrain.storage import open_store
from tests.planted import plant_snapshot


def _job(url: str, seed: int = 0, **kw: Any) -> tuple[torch.nn.Module, Any, et.SnapshotManager]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32),
                                torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt, et.SnapshotManager(url, model=model, optimizer=opt, every_steps=5, **kw)


def _train(model: torch.nn.Module, opt: Any, snap: et.SnapshotManager, until: int) -> None:
    data = torch.randn(8, 32, generator=torch.Generator().manual_seed(3))
    while snap.step_count < until:
        opt.zero_grad()
        model(data).pow(2).mean().backward()
        opt.step()
        snap.step()


def _flip_a_model_byte(url: str, step: int) -> None:
    """Corrupt one byte inside a saved parameter's bytes (not the pickle): the pass
    has written the model before the checksum can tell."""
    store = open_store(url)
    path = store.local_path(f"{layout.step_dir(step)}/{layout.PAYLOAD}")
    assert path is not None
    flip_a_parameter_byte(path)


def flip_a_parameter_byte(payload: str | Path) -> None:
    """Flip one bit inside the first saved tensor's bytes of ``payload``."""
    plan = onepass.plan(str(payload))
    assert plan is not None
    region = plan.regions[0]
    with open(payload, "r+b") as f:
        f.seek(region.offset + 8)
        byte = f.read(1)
        f.seek(region.offset + 8)
        f.write(bytes([byte[0] ^ 0x40]))


def _values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_restore_fills_the_models_own_memory(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    model, opt, snap = _job(url)
    _train(model, opt, snap, 10)
    snap.close()
    saved = _values(model)
    fresh, _, again = _job(url, seed=1)
    addresses = {k: v.data_ptr() for k, v in fresh.state_dict().items()}
    assert not all(torch.equal(saved[k], v) for k, v in fresh.state_dict().items())
    placed: list[int] = []
    real = onepass._placements
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(onepass, "_placements",
                      lambda *a: (found := real(*a), placed.append(len(found)))[0])
        assert again.restore().from_step == 10
    # Every model tensor (weights, biases, BatchNorm statistics) was read in place.
    assert placed == [len(saved)]
    assert {k: v.data_ptr() for k, v in fresh.state_dict().items()} == addresses
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, saved[key]), key
    again.close()


def test_tensors_that_share_saved_bytes_come_back_through_fresh_memory(
        tmp_path: Path) -> None:
    """A model tensor whose bytes are also another saved tensor's (a view saved with
    its base, an extra holding the same storage) is not read in place: reading it
    there would leave the other one's fresh memory unfilled."""
    store = open_store(str(tmp_path / "store"))
    base = torch.arange(64.0)
    state = {"step": 3, "model": {"w": base, "w_view": base[8:16], "alone": torch.ones(5)},
             "extras": {"same": torch.full((4,), 7.0)}}
    state["model"]["shared_with_extra"] = state["extras"]["same"]
    plant_snapshot(store, 3, state)
    targets = {("model", k): torch.zeros_like(v) for k, v in state["model"].items()}
    in_place = onepass.InPlace(targets)
    loaded = verify_snapshot(store, 3, load=True, in_place=in_place).payload
    assert loaded is not None
    assert loaded["model"]["alone"] is targets[("model", "alone")]  # the only one placed
    for key in ("w", "w_view", "shared_with_extra"):
        assert loaded["model"][key] is not targets[("model", key)]
        assert not targets[("model", key)].any()  # never written
    for key, value in state["model"].items():
        assert torch.equal(loaded["model"][key], value)
    assert torch.equal(loaded["extras"]["same"], state["extras"]["same"])


def test_tied_targets_receive_one_saved_range(tmp_path: Path) -> None:
    """Two model keys that are one tensor, saved once: read once into it."""
    store = open_store(str(tmp_path / "store"))
    shared = torch.randn(16)
    plant_snapshot(store, 3, {"step": 3, "model": {"a": shared, "b": shared}})
    tied = torch.zeros(16)
    in_place = onepass.InPlace({("model", "a"): tied, ("model", "b"): tied})
    loaded = verify_snapshot(store, 3, load=True, in_place=in_place).payload
    assert loaded is not None and in_place.touched
    assert loaded["model"]["a"] is tied and loaded["model"]["b"] is tied
    assert torch.equal(tied, shared)


def test_a_corrupt_newest_snapshot_is_overwritten_by_the_older_one(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    model, opt, snap = _job(url, keep=3)
    _train(model, opt, snap, 5)
    snap.wait()
    at_5 = _values(model)
    _train(model, opt, snap, 10)
    snap.close()
    _flip_a_model_byte(url, 10)
    fresh, _, again = _job(url, seed=1, keep=3)
    with capture_logs() as logs:
        info = again.restore()
    assert info.from_step == 5
    assert [e["snapshot_step"] for e in logs if e["event"] == "snapshot.corrupt"] == [10]
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, at_5[key]), key
    again.close()


def test_when_nothing_verifies_after_an_in_place_read_the_run_stops_and_keeps_everything(
        tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    model, opt, snap = _job(url)
    _train(model, opt, snap, 5)
    snap.close()
    _flip_a_model_byte(url, 5)
    payload = Path(url, layout.step_dir(5), layout.PAYLOAD)
    before = payload.read_bytes()
    _, _, again = _job(url, seed=1)
    with pytest.raises(RestoreOverwrote, match=r"no committed snapshot verifies .* fix: list "
                                                r"them with `elastictrain snapshots verify") as err:
        again.restore()
    assert err.value.exit_code == EXIT_FATAL
    assert list_snapshot_dirs(again.store) == [5] and payload.read_bytes() == before
    again.close()


def test_a_snapshot_without_a_manifest_still_means_a_fresh_start(tmp_path: Path) -> None:
    """Nothing is read from a partial write, so the model keeps its initial values."""
    url = str(tmp_path / "run")
    model, opt, snap = _job(url)
    _train(model, opt, snap, 5)
    snap.close()
    Path(url, layout.step_dir(5), layout.MANIFEST).unlink()
    fresh, _, again = _job(url, seed=1)
    initial = _values(fresh)
    assert again.restore().from_step is None
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, initial[key])
    again.close()


def test_a_resume_refused_on_the_snapshots_structure_leaves_the_model_alone(
        tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = et.SnapshotManager(url, model=model, optimizer=opt,
                              sampler=et.ElasticSampler(100, 4), every_steps=1)
    snap.step()
    snap.close()
    other = torch.nn.Linear(4, 4)
    initial = _values(other)
    again = et.SnapshotManager(url, model=other, optimizer=torch.optim.SGD(
        other.parameters(), lr=0.1), sampler=et.ElasticSampler(30, 4), every_steps=1)
    with pytest.raises(ResumeMismatchError, match="dataset has 30 samples"):
        again.restore()
    for key, value in other.state_dict().items():
        assert torch.equal(value, initial[key])
    again.close()
