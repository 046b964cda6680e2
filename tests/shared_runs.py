"""Demo runs shared by tests that check different things of one run: each runs once a
session, whichever test asks first (registered in tests/conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import run_demo_json


@pytest.fixture(scope="session")
def one_kill_demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``elastictrain demo --json`` of 60 steps, a snapshot every 10, a worker SIGKILLed
    at step 34: what the run reports is checked in test_demo_resume.py, what ``status``
    makes of its storage in test_status.py. ``storage`` is added to the demo's JSON."""
    tmp = tmp_path_factory.mktemp("one-kill")
    out = run_demo_json(tmp, f"--storage={tmp / 's'}", "--steps=60", "--snapshot-every=10",
                        "--kill-at=34")
    return {**out, "storage": str(tmp / "s")}


@pytest.fixture(scope="session")
def two_kills_demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``elastictrain demo --json`` of 100 steps (seed 3, a snapshot every 25 steps, the
    default) with workers SIGKILLed at steps 40 and 80 (one kill of the writer): its
    result is checked in test_demo_resume.py, its goodput split in
    test_goodput_split_demo.py."""
    tmp = tmp_path_factory.mktemp("two-kills")
    return run_demo_json(tmp, f"--storage={tmp / 's'}", "--steps=100", "--seed=3",
                         "--snapshot-every=25", "--kill-at=40", "--kill-at=80")
