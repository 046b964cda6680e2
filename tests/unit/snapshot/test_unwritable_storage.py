"""A local snapshot storage that cannot be written (a file in the way of its root) is
refused when the manager is built: a ConfigError (exit 78: a setting to fix, which a
restart would only meet again) naming the path and the fix, and nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import elastictrain as et
from elastictrain.core.errors import EXIT_FATAL, ConfigError


def test_a_file_in_the_way_of_the_root_is_one_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError) as info:
        et.SnapshotManager(str(blocker / "run"), model=torch.nn.Linear(2, 1))
    message = str(info.value)
    assert info.value.exit_code == EXIT_FATAL
    assert str(blocker / "run") in message and "fix:" in message
    assert "\n" not in message
    assert blocker.read_text() == "x" and sorted(tmp_path.iterdir()) == [blocker]
