"""``snapshot.persist_max_mb_s`` in the process persister (a child process writes): the
pace holds and a run that ends lifts it, as in the thread persister
(tests/unit/snapshot/durable/test_pacing.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.snapshot.durable.test_pacing import check_a_paced_persist, check_close_at_full_speed

pytestmark = pytest.mark.processes


def test_a_paced_persist_in_the_process_persister(tmp_path: Path) -> None:
    check_a_paced_persist(tmp_path, sharded=False, persister="process")


def test_close_finishes_a_paced_save_of_the_process_persister(tmp_path: Path) -> None:
    check_close_at_full_speed(tmp_path, "process")
