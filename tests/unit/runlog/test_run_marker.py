"""One run per storage (runlog/run_marker.py): the first launch whose manager accepts the
storage names the run, later launches adopt it, a named run id wins, and a marker that
is not ours is never changed."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from elastictrain.core.errors import StorageError
from elastictrain.runlog.run_marker import RUN_MARKER, record_run_id, storage_run_id
from elastictrain.storage import open_store


def _launch(store: object, proposed: str, *, named: bool = False) -> str:
    """What a manager does: the storage's id, recorded once the storage is accepted."""
    run_id = storage_run_id(store, proposed, named=named)  # type: ignore[arg-type]
    record_run_id(store, run_id)  # type: ignore[arg-type]
    return run_id


def test_the_first_launch_names_the_run_and_later_launches_adopt_it(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    assert storage_run_id(store, "et-first") == "et-first"
    assert not (tmp_path / RUN_MARKER).exists()  # reading writes nothing
    assert _launch(store, "et-first") == "et-first"
    assert _launch(store, "et-second") == "et-first"
    assert json.loads((tmp_path / RUN_MARKER).read_text())["run_id"] == "et-first"


def test_a_named_run_id_is_used_as_given_and_recorded_only_when_none_is(tmp_path: Path
                                                                        ) -> None:
    store = open_store(str(tmp_path))
    assert _launch(store, "slurm-41", named=True) == "slurm-41"
    assert _launch(store, "slurm-42", named=True) == "slurm-42"
    assert _launch(store, "et-later") == "slurm-41"  # the first one recorded


@pytest.mark.parametrize("unnamed", ["none", "local", ""])
def test_torchruns_default_id_is_replaced_by_one_from_the_launch(
        tmp_path: Path, unnamed: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTICTRAIN_LAUNCH_ID", "20261129T120000Z-abcd")
    store = open_store(str(tmp_path))
    assert storage_run_id(store, unnamed) == "et-20261129T120000Z-abcd"  # every worker's


@pytest.mark.parametrize("content", [b"not json", b'{"run_id": "../../etc"}', b"[1, 2]",
                                     b'{"other": 1}'])
def test_a_marker_that_is_not_ours_is_left_as_it_is(tmp_path: Path, content: bytes) -> None:
    (tmp_path / RUN_MARKER).write_bytes(content)
    store = open_store(str(tmp_path))
    assert _launch(store, "et-mine") == "et-mine"
    assert (tmp_path / RUN_MARKER).read_bytes() == content


def test_a_storage_that_refuses_the_marker_leaves_the_launch_its_own_id(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(str(tmp_path))

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise StorageError("access denied")

    monkeypatch.setattr(store, "write_bytes", refuse)
    assert _launch(store, "et-mine") == "et-mine"
    monkeypatch.setattr(store, "read_bytes", refuse)
    assert _launch(store, "et-other") == "et-other"


def test_ranks_recording_at_once_leave_one_marker(tmp_path: Path) -> None:
    """Every rank of a launch proposes the same id: one write wins, none fails."""
    store = open_store(str(tmp_path))
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda _: _launch(store, "et-launch"), range(8)))
    assert set(ids) == {"et-launch"}
    assert json.loads((tmp_path / RUN_MARKER).read_text())["run_id"] == "et-launch"
