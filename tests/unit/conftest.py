"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elastictrain.core.config import PreemptConfig
from elastictrain.worker import preempt


@pytest.fixture
def watcher() -> Iterator[preempt.PreemptionWatcher]:
    installed = preempt.install(PreemptConfig(signals=[]), poll=False)
    assert installed is not None
    try:
        yield installed
    finally:
        preempt.uninstall()
