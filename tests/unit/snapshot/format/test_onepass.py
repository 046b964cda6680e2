"""Restoring a local payload in one pass: torch.load(mmap=True) says where each
storage lies, the file is read once into fresh storages and checksummed on the way.

The state must come back bit-exact whatever its tensors look like (views, shared
storages, empty and 0-d tensors, several dtypes); a flipped byte anywhere is
corruption; a read error is a read error; a layout the plan does not recognise is
streamed instead, with the same verdicts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from elastictrain.core import layout
from elastictrain.core.errors import SnapshotCorrupt, StorageError
from elastictrain.snapshot.format import onepass
from elastictrain.snapshot.format.reader import verify_snapshot
from elastictrain.storage import FsspecStore, open_store
from tests.fault_stores import FailingReads
from tests.planted import plant_snapshot


def _awkward_state() -> dict[str, Any]:
    base = torch.arange(4096, dtype=torch.float32)
    return {
        "step": 7,
        "big": torch.randn(300_000),
        "view": base[100:200],  # a view into a storage also saved whole
        "base": base,
        "strided": torch.arange(64, dtype=torch.int64).reshape(8, 8).t(),
        "half": torch.randn(33, dtype=torch.float16),
        "empty": torch.empty(0),
        "scalar": torch.tensor(3.5),
        "flags": torch.tensor([True, False, True]),
        "nested": [{"m": torch.ones(5, dtype=torch.bfloat16)}, (torch.zeros(2, 3),)],
    }


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
        return
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
        return
    assert a == b


@pytest.fixture
def store(tmp_path: Path) -> FsspecStore:
    return open_store(str(tmp_path / "store"))


def _payload_path(store: FsspecStore, step: int) -> str:
    path = store.local_path(f"{layout.step_dir(step)}/{layout.PAYLOAD}")
    assert path is not None
    return path


def test_an_awkward_state_comes_back_exactly_through_the_planned_read(
        store: FsspecStore, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _awkward_state()
    plant_snapshot(store, 7, state)
    assert onepass.plan(_payload_path(store, 7)) is not None  # the one-pass path, not the stream
    reads: list[int] = []
    real_read = onepass.read
    monkeypatch.setattr(onepass, "read", lambda *a: reads.append(1) or real_read(*a))
    loaded = verify_snapshot(store, 7, load=True).payload
    assert reads == [1]
    _assert_same(state, loaded)
    # Views share one fresh storage again, as they did when saved.
    assert loaded is not None
    shared = {loaded[k].untyped_storage().data_ptr() for k in ("view", "base")}
    assert len(shared) == 1
    # Nothing is left mapped from the file: writing the tensors never touches it.
    before = Path(_payload_path(store, 7)).read_bytes()
    loaded["big"].add_(1)
    assert Path(_payload_path(store, 7)).read_bytes() == before


@pytest.mark.parametrize("where", ["first storage", "last storage", "pickle", "directory"])
def test_a_flipped_byte_anywhere_is_corruption(store: FsspecStore, where: str) -> None:
    plant_snapshot(store, 7, _awkward_state())
    path = _payload_path(store, 7)
    layout_plan = onepass.plan(path)
    assert layout_plan is not None
    regions = layout_plan.regions
    offset = {"first storage": regions[0].offset + regions[0].nbytes // 2,
              "last storage": regions[-1].offset + regions[-1].nbytes - 1,
              "pickle": 100,
              "directory": os.path.getsize(path) - 30}[where]
    data = bytearray(Path(path).read_bytes())
    data[offset] ^= 0x01
    Path(path).write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt, match=r"crc32 \w+ != manifest"):
        verify_snapshot(store, 7, load=True)


def test_a_payload_it_cannot_plan_is_streamed_with_the_same_result(
        store: FsspecStore, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _awkward_state()
    plant_snapshot(store, 7, state)
    monkeypatch.setattr(onepass, "plan", lambda path: None)
    loaded = verify_snapshot(store, 7, load=True).payload
    _assert_same(state, loaded)


def test_plan_refuses_what_is_not_a_torch_zip(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a zip at all" * 100)
    assert onepass.plan(str(junk)) is None


def test_a_read_error_during_the_pass_is_a_read_error_not_corruption(
        store: FsspecStore) -> None:
    plant_snapshot(store, 7, _awkward_state())
    failing = FailingReads(store, match=layout.PAYLOAD)
    with pytest.raises(StorageError, match="injected throttling") as caught:
        verify_snapshot(failing, 7, load=True)
    assert not isinstance(caught.value, SnapshotCorrupt)
    assert failing.failed >= 1


def test_a_file_that_shrinks_after_the_plan_is_a_read_error(
        store: FsspecStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The size is checked before the pass; a file cut during it (a racing writer
    outside elastictrain) ends early: a read error, never a silent short state."""
    plant_snapshot(store, 7, _awkward_state())
    path = _payload_path(store, 7)
    real_read = onepass.read

    def cut_then_read(f: Any, size: int, *rest: Any) -> Any:
        os.truncate(path, size // 2)
        return real_read(f, size, *rest)

    monkeypatch.setattr(onepass, "read", cut_then_read)
    with pytest.raises(StorageError, match="ends after"):
        verify_snapshot(store, 7, load=True)


def test_a_truncated_payload_is_corruption_before_any_read(store: FsspecStore) -> None:
    plant_snapshot(store, 7, _awkward_state())
    path = _payload_path(store, 7)
    os.truncate(path, os.path.getsize(path) - 1)
    with pytest.raises(SnapshotCorrupt, match="manifest says"):
        verify_snapshot(store, 7, load=True)


def test_a_pickle_larger_than_the_scratch_buffer_is_hashed_through_it(
        store: FsspecStore) -> None:
    """A 9 MiB string lives in the pickle, before the first storage: the gap is read
    through the 8 MiB scratch buffer twice and must still hash in order."""
    state = {"step": 7, "note": "x" * (9 << 20), "w": torch.arange(10_000.0)}
    plant_snapshot(store, 7, state)
    layout_plan = onepass.plan(_payload_path(store, 7))
    assert layout_plan is not None and layout_plan.regions[0].offset > onepass._SCRATCH
    _assert_same(state, verify_snapshot(store, 7, load=True).payload)
