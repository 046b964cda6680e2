"""Case 7: storage retries never draw from the user's Python RNG stream."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from elastictrain.storage import open_store


def test_retried_read_leaves_global_random_state_unchanged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(str(tmp_path / "run"), retries=3, retry_backoff_s=0.001)
    store.write_bytes("obj", b"payload")
    real = store.fs.cat_file
    calls = {"n": 0}

    def flaky(path: str, *args: Any, **kwargs: Any) -> bytes:
        calls["n"] += 1
        if calls["n"] <= 2:  # two transient faults, then success
            raise ConnectionResetError("injected")
        return bytes(real(path, *args, **kwargs))

    monkeypatch.setattr(store.fs, "cat_file", flaky)
    random.seed(1234)
    before = random.getstate()
    assert store.read_bytes("obj") == b"payload"
    assert calls["n"] == 3  # the read really was retried
    assert random.getstate() == before
