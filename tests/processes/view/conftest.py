"""Fixtures of the view tests."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.processes.view.terminal import Tmux


@pytest.fixture
def tmux() -> Iterator[Tmux]:
    """A private tmux server, killed at the end (with what runs in it)."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    server = Tmux()
    try:
        yield server
    finally:
        server.kill()
