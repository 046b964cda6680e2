"""A tampered snapshot never comes with advice to allowlist what it calls (issue 24,
case 7).

The newest payload is replaced by a pickle that calls a code-running global, its
manifest re-checksummed to match, signing off: the restricted unpickler refuses it
(nothing runs), the run stops with 78, and the message says the snapshot may have
been tampered with, names signing and the previous snapshot, and never suggests
``add_safe_globals``. An unknown plain class still gets that advice."""

from __future__ import annotations

import builtins
import dataclasses
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

import elastictrain as et
from elastictrain.core import layout
from elastictrain.core.errors import EXIT_FATAL, SnapshotUnloadable
from elastictrain.storage import open_store
from tests.planted import plant_snapshot


class _Calls:
    """Pickles as a call of ``func(*args)`` (what a tampered payload holds)."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


@dataclasses.dataclass
class Point:
    x: int


def _job(url: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, et.SnapshotManager]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, et.SnapshotManager(url, model=model, optimizer=opt, every_steps=5)


def _replace_newest(url: str, value: Any) -> None:
    model, opt, snap = _job(url)
    while snap.step_count < 10:
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        snap.step()
    snap.close()
    store = open_store(url)
    store.delete(layout.step_dir(10), recursive=True)
    plant_snapshot(store, 10, {"model": value})  # payload and a manifest that matches it


@pytest.mark.parametrize("call", [
    pytest.param(lambda marker: _Calls(os.system, f"touch {marker}"), id="os.system"),
    pytest.param(lambda marker: _Calls(subprocess.call, ["touch", str(marker)]),
                 id="subprocess.call"),
    pytest.param(lambda marker: _Calls(builtins.eval, f"open({str(marker)!r}, 'w')"),
                 id="builtins.eval"),
])
def test_a_payload_that_calls_code_says_tampered_and_never_advises_allowlisting(
        tmp_path: Path, call: Any) -> None:
    url, marker = str(tmp_path / "run"), tmp_path / "ran"
    _replace_newest(url, call(marker))
    _, _, snap = _job(url)
    with pytest.raises(SnapshotUnloadable) as raised:
        snap.restore()
    snap.close()
    message = str(raised.value)
    assert raised.value.exit_code == EXIT_FATAL
    assert not marker.exists()  # refused before anything was called
    assert "add_safe_globals" not in message
    assert "may have been tampered with" in message and "ELASTICTRAIN_SIGNING_KEY" in message
    assert "previous snapshot" in message and "elastictrain snapshots verify" in message


def test_an_unknown_plain_class_still_gets_the_allowlist_advice(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    _replace_newest(url, Point(1))
    _, _, snap = _job(url)
    with pytest.raises(SnapshotUnloadable, match=r"if you trust the type call "
                       r"torch.serialization.add_safe_globals\(\[.*Point\]\)") as raised:
        snap.restore()
    snap.close()
    assert "may have been tampered" not in str(raised.value)


@pytest.mark.parametrize(("name", "runs"), [
    ("posix.system", True), ("nt.system", True), ("os.system", True),
    ("subprocess.Popen", True), ("builtins.getattr", True), ("builtins.__import__", True),
    ("builtins.exec", True), ("torch.hub.load", True), ("__builtin__.eval", True),
    ("eval", True), ("getattr", True), ("commands.call", True),
    ("collections.OrderedDict", False), ("mylib.config.TrainState", False),
    ("torch.nn.Linear", False),
])
def test_runs_code(name: str, runs: bool) -> None:
    from elastictrain.snapshot.format.loadable import runs_code  # here: the others run without it

    assert runs_code(name) is runs
