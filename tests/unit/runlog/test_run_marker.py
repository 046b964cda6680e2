"""One run per storage (runlog/run_marker.py): the first launch names the run, later
launches adopt it, a named run id wins, and a marker that is not ours is never changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastictrain.core.errors import StorageError
from elastictrain.runlog.run_marker import RUN_MARKER, storage_run_id
from elastictrain.storage import open_store


def test_the_first_launch_names_the_run_and_later_launches_adopt_it(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    assert storage_run_id(store, "et-first") == "et-first"
    assert storage_run_id(store, "et-second") == "et-first"
    assert json.loads((tmp_path / RUN_MARKER).read_text())["run_id"] == "et-first"


def test_a_named_run_id_is_used_as_given_and_recorded_only_when_none_is(tmp_path: Path
                                                                        ) -> None:
    store = open_store(str(tmp_path))
    assert storage_run_id(store, "slurm-41", named=True) == "slurm-41"
    assert storage_run_id(store, "slurm-42", named=True) == "slurm-42"
    assert storage_run_id(store, "et-later") == "slurm-41"  # the first one recorded


@pytest.mark.parametrize("unnamed", ["none", "local", ""])
def test_torchruns_default_id_is_replaced_by_a_generated_one(tmp_path: Path, unnamed: str
                                                             ) -> None:
    store = open_store(str(tmp_path))
    first = storage_run_id(store, unnamed)
    assert first.startswith("et-") and storage_run_id(store, unnamed) == first


@pytest.mark.parametrize("content", [b"not json", b'{"run_id": "../../etc"}', b"[1, 2]",
                                     b'{"other": 1}'])
def test_a_marker_that_is_not_ours_is_left_as_it_is(tmp_path: Path, content: bytes) -> None:
    (tmp_path / RUN_MARKER).write_bytes(content)
    store = open_store(str(tmp_path))
    assert storage_run_id(store, "et-mine") == "et-mine"
    assert (tmp_path / RUN_MARKER).read_bytes() == content


def test_a_storage_that_refuses_the_marker_leaves_the_launch_its_own_id(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(str(tmp_path))

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise StorageError("access denied")

    monkeypatch.setattr(store, "write_bytes", refuse)
    assert storage_run_id(store, "et-mine") == "et-mine"
    monkeypatch.setattr(store, "read_bytes", refuse)
    assert storage_run_id(store, "et-other") == "et-other"


def test_ranks_racing_for_the_marker_all_read_the_winner(tmp_path: Path) -> None:
    """Every rank proposes its own id at once: one write wins, all return it."""
    from concurrent.futures import ThreadPoolExecutor

    store = open_store(str(tmp_path))
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda i: storage_run_id(store, f"et-rank{i}"), range(8)))
    assert len(set(ids)) == 1 and ids[0].startswith("et-rank")
