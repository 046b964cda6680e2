"""Claiming a fresh memory directory while another local rank of the same run claims it
too: whichever writes the identity first, both go on; a different run that claims it
first is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastictrain.core.errors import ConfigError
from elastictrain.snapshot.memory import memory


def _claimed_meanwhile(monkeypatch: pytest.MonkeyPatch, path: Path, storage: str) -> None:
    """The other claimant writes its identity just after our first look found none."""
    looked = memory._foreign_entries

    def look_then_claim(where: Path) -> list[str]:
        found = looked(where)
        monkeypatch.setattr(memory, "_foreign_entries", looked)
        assert memory._write_identity(where, {"storage": storage, "run_id": "r", "uid": 0},
                                      only_if_absent=True)
        return found

    monkeypatch.setattr(memory, "_foreign_entries", look_then_claim)


def test_a_rank_of_the_same_run_claiming_at_once_is_no_stranger(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mem"
    path.mkdir()
    _claimed_meanwhile(monkeypatch, path, "file:///data/run")
    memory._claim(path, "file:///data/run", "r", "memory_dir")
    assert memory.read_identity(path) == {"storage": "file:///data/run", "run_id": "r",
                                          "uid": 0}
    assert sorted(p.name for p in path.iterdir()) == [memory.IDENTITY]  # no temporary left


def test_another_run_claiming_first_is_refused(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mem"
    path.mkdir()
    _claimed_meanwhile(monkeypatch, path, "file:///data/other")
    with pytest.raises(ConfigError, match="another run"):
        memory._claim(path, "file:///data/run", "r", "memory_dir")
    assert memory.read_identity(path)["storage"] == "file:///data/other"  # type: ignore[index]
