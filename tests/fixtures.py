"""Fixtures of tests in several folders (registered in tests/conftest.py): a real moto
S3 server for the session with a fresh bucket per test, an installed preemption watcher
that polls nothing, a watchdog whose exits are recorded, a private node memory root, a
process group of the test's process alone."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import structlog
import torch.distributed as dist

from elastictrain.core.config import PreemptConfig, WatchdogConfig
from elastictrain.worker import preempt, watchdog

if TYPE_CHECKING:
    from tests.s3server import MotoS3, S3Bucket


@pytest.fixture
def watcher() -> Iterator[preempt.PreemptionWatcher]:
    installed = preempt.install(PreemptConfig(signals=[]), poll=False)
    assert installed is not None
    try:
        yield installed
    finally:
        preempt.uninstall()


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoS3]:
    """moto's S3 on 127.0.0.1 at a free port, stopped at the end of the session."""
    pytest.importorskip("moto.moto_server.werkzeug_app", reason="needs moto[server] (test extra)")
    pytest.importorskip("s3fs", reason="needs s3fs (the s3 extra)")
    from tests.s3server import moto_session

    yield from moto_session()


@pytest.fixture
def s3(moto_server: MotoS3) -> Iterator[S3Bucket]:
    """A reset server with one empty bucket; fsspec's instance cache cleared around it."""
    from tests.s3server import fresh_bucket

    yield from fresh_bucket(moto_server)


@pytest.fixture
def watchdog_exits() -> Iterator[Callable[[], list[int]]]:
    """Installs (when called) a process-wide watchdog with a 0.5 s step limit whose
    exit is recorded, not taken; returns the list of exit codes."""
    exits: list[int] = []
    config = WatchdogConfig(timeout_s=0.5, startup_timeout_s=60, check_interval_s=0.05,
                            backstop=False)

    def install() -> list[int]:
        watchdog._current = watchdog.Watchdog(config, exit_fn=exits.append).start()
        return exits

    try:
        yield install
    finally:
        watchdog.uninstall()


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private node memory root (``ELASTICTRAIN_SHM``) for the test."""
    root = tmp_path / "shm"
    root.mkdir(mode=0o1777)
    monkeypatch.setenv("ELASTICTRAIN_SHM", str(root))
    return root


@pytest.fixture
def logging_reset() -> Iterator[None]:
    """Logging as it was before the test: for a test that calls the CLI's ``main()``
    (it points the log at the test's captured stderr)."""
    yield
    structlog.reset_defaults()


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of this process alone (DDP and FSDP2 need one)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/group", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
