"""Fixtures shared by the memory tier's end-to-end tests: each uninterrupted reference
run happens once per session, however many modules compare against it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.processes.memtier.test_memtier_e2e import Agents, _digest, _log
from tests.processes.memtier.test_sharded_peer_e2e import FSDP


@pytest.fixture(scope="session")
def reference_digest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The final parameters' digest of an uninterrupted two-worker run, shared by the
    bit-exact checks: a run's parameters do not depend on its snapshot policy (this run
    takes a memory snapshot every step, the rescue runs one every 1000 steps)."""
    tmp = tmp_path_factory.mktemp("reference")
    agents = Agents(tmp)
    try:
        ref = agents.start("ref", tmp / "ref", tmp / "mem-ref", nproc=2)
        assert ref.wait(timeout=300) == 0, _log(agents)
        yield _digest(tmp / "ev" / "ref")
    finally:
        agents.stop_all()


@pytest.fixture(scope="session")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The final parameters' digest of an uninterrupted two-worker FSDP run."""
    tmp = tmp_path_factory.mktemp("fsdp-reference")
    started = Agents(tmp)
    try:
        ref = started.start("ref", tmp / "ref", tmp / "mem-ref", nproc=2, extra=(FSDP,))
        assert ref.wait(timeout=400) == 0, _log(started)
        yield _digest(tmp / "ev" / "ref")
    finally:
        started.stop_all()
