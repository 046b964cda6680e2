"""The launch id of a worker: the launcher's when it gives one; under plain torchrun one
made from the torchrun agent (the parent), the same for every worker it starts in every
attempt; without a launcher a new one."""

from __future__ import annotations

import os

import pytest

from elastictrain.core.env import LAUNCH_ID_VAR
from elastictrain.runlog import events


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "_own_launch_id", None)
    monkeypatch.delenv(LAUNCH_ID_VAR, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


def test_the_launchers_id_comes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LAUNCH_ID_VAR, "20261129T000000Z-abcd")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert events.launch_id() == "20261129T000000Z-abcd"


def test_workers_of_one_torchrun_agent_share_one_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers (or two attempts' workers) of one agent: the same parent process."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setattr(os, "getppid", os.getpid)  # this process plays the agent
    first = events.launch_id()
    monkeypatch.setattr(events, "_own_launch_id", None)  # another worker process
    assert events.launch_id() == first
    monkeypatch.setattr(events, "_own_launch_id", None)
    monkeypatch.setattr(os, "getppid", lambda: 1)  # another agent (another node)
    assert events.launch_id() != first


def test_without_a_launcher_each_process_has_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python train.py`` from one shell, twice: two launches, not one."""
    monkeypatch.setattr(os, "getppid", os.getpid)
    first = events.launch_id()
    monkeypatch.setattr(events, "_own_launch_id", None)
    assert events.launch_id() != first
