"""The commit marker: one module writes ``MANIFEST.json`` and answers whether a step is
committed, for every tier; its two ways of committing keep or replace a committed copy
as their callers ask."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from elastictrain.core import layout
from elastictrain.snapshot.format.commitmark import (
    commit_by_rename,
    commit_in_place,
    is_committed,
    read_marker,
)
from elastictrain.storage import open_store
from elastictrain.storage.api import Store
from tests.helpers import REPO

SOURCE = REPO / "elastictrain"


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return open_store(str(tmp_path / "store"))


def _partial(store: Store, step: int, token: str, payload: bytes) -> str:
    partial = layout.partial_dir(step, token)
    store.write_bytes(f"{partial}/{layout.PAYLOAD}", payload)
    return partial


def test_in_place_exclusive_commits_once(store: Store) -> None:
    store.write_bytes(f"{layout.step_dir(3)}/state-a.pt", b"a")
    assert not is_committed(store, 3)
    assert commit_in_place(store, 3, b'{"a": 1}', exclusive=True)
    assert not commit_in_place(store, 3, b'{"b": 2}', exclusive=True)  # the second loses
    assert read_marker(store, 3) == b'{"a": 1}'
    assert commit_in_place(store, 3, b'{"c": 3}', exclusive=False)  # a node's own copy
    assert read_marker(store, 3) == b'{"c": 3}'


def test_by_rename_keeps_a_committed_step_unless_told_to_replace(store: Store) -> None:
    first = _partial(store, 5, "aaaa", b"first")
    assert commit_by_rename(store, first, 5, b"m1", replace=False)
    second = _partial(store, 5, "bbbb", b"second")
    assert not commit_by_rename(store, second, 5, b"m2", replace=False)
    assert store.read_bytes(f"{layout.step_dir(5)}/{layout.PAYLOAD}") == b"first"
    assert store.exists(second)  # left to the caller, which deletes it
    assert commit_by_rename(store, second, 5, b"m2", replace=True)  # the agreed copy
    assert store.read_bytes(f"{layout.step_dir(5)}/{layout.PAYLOAD}") == b"second"
    assert read_marker(store, 5) == b"m2"


def test_by_rename_clears_an_uncommitted_leftover(store: Store) -> None:
    store.write_bytes(f"{layout.step_dir(7)}/{layout.PAYLOAD}", b"torn")  # no marker
    partial = _partial(store, 7, "cccc", b"whole")
    assert commit_by_rename(store, partial, 7, b"m", replace=False)
    assert store.read_bytes(f"{layout.step_dir(7)}/{layout.PAYLOAD}") == b"whole"


def test_a_check_that_raises_before_the_rename_commits_nothing(store: Store) -> None:
    partial = _partial(store, 9, "dddd", b"x")

    def refuse() -> None:
        raise RuntimeError("the run ended")

    with pytest.raises(RuntimeError):
        commit_by_rename(store, partial, 9, b"m", replace=False, before_commit=refuse)
    assert not is_committed(store, 9)


def test_only_the_marker_module_names_the_marker_in_a_path() -> None:
    """Every tier commits and asks through snapshot/format/commitmark.py: a path built from
    ``layout.MANIFEST`` anywhere else is a second commit protocol."""
    path_use = re.compile(r"/\{layout\.MANIFEST\}|MANIFEST\.json[\"']")
    offenders = [str(p.relative_to(SOURCE)) for p in sorted(SOURCE.rglob("*.py"))
                 if p.name not in ("commitmark.py", "layout.py")  # the user, the name
                 and path_use.search(p.read_text())]
    assert offenders == []
