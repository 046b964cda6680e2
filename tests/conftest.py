"""The test tiers (tests/README.md): a test that starts a process is marked ``processes``,
directly or through ``distributed`` or ``bench``, which imply it; the fast tier is
``python -m pytest -m "not processes"``. An unmarked test that starts one fails."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import structlog

# Demo runs that several test modules check (one run each per session).
pytest_plugins = ["tests.shared_runs", "tests.fixtures"]

# Markers that start processes by definition.
IMPLY_PROCESSES = ("distributed", "bench")


# Session and module fixtures that run a whole job (tests/shared_runs.py, the memory
# tier's uninterrupted references, FSDP2's): the tests that share one are kept on one
# pytest-xdist worker (``--dist loadgroup``), so the job runs once.
SHARED_RUNS = ("one_kill_demo", "two_kills_demo", "reference_digest", "fsdp_reference",
               "fsdp_uninterrupted")


# The folder says the tier: tests/unit holds the fast tier, tests/processes the tests
# that start processes; a test in the wrong one is an error at collection.
FOLDER_OF_TIER = {False: "unit", True: "processes"}


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    misplaced: list[str] = []
    for item in items:
        if any(item.get_closest_marker(name) for name in IMPLY_PROCESSES):
            item.add_marker(pytest.mark.processes)
        starts = item.get_closest_marker("processes") is not None
        folder = item.path.relative_to(Path(__file__).parent).parts[0]
        if folder != FOLDER_OF_TIER[starts]:
            misplaced.append(f"{item.nodeid}: {'marked' if starts else 'not marked'} "
                             f"processes, so it belongs under tests/{FOLDER_OF_TIER[starts]}/")
        shared = [name for name in SHARED_RUNS if name in getattr(item, "fixturenames", ())]
        if shared:
            item.add_marker(pytest.mark.xdist_group(shared[0]))
    if misplaced:
        raise pytest.UsageError("tests in the wrong tier's folder (tests/README.md):\n  "
                                + "\n  ".join(misplaced))


def _noting(original: Callable[..., Any], what: str, seen: list[str]) -> Callable[..., Any]:
    def noted(*args: Any, **kwargs: Any) -> Any:
        seen.append(what(*args) if callable(what) else what)
        return original(*args, **kwargs)

    return noted


def _popen_name(_self: object, args: Any = None, *_: Any) -> str:
    first = args[0] if isinstance(args, (list, tuple)) and args else args
    return f"subprocess.Popen({str(first)[-60:]!r}, ...)"


@contextmanager
def _watching_spawns(seen: list[str]) -> Iterator[None]:
    """Note every process started meanwhile (in ``seen``): a Popen, a fork, a
    multiprocessing start or os.posix_spawn. (Not os.system: a test pickles it by name.)"""
    patches: list[tuple[Any, str, Any]] = [
        (subprocess.Popen, "__init__", _popen_name),
        (os, "fork", "os.fork()"),
        (os, "posix_spawn", "os.posix_spawn()"),
        (os, "posix_spawnp", "os.posix_spawnp()"),
        (multiprocessing.process.BaseProcess, "start", "multiprocessing Process.start()"),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for (owner, name, what), (_, _, original) in zip(patches, originals, strict=True):
            setattr(owner, name, _noting(original, what, seen))
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


@pytest.fixture(autouse=True)
def _processes_are_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test not marked ``processes`` fails if it starts a process: the fast tier
    (``-m "not processes"``) stays free of them."""
    if request.node.get_closest_marker("processes") is not None:
        yield
        return
    seen: list[str] = []
    with _watching_spawns(seen):
        yield
    if seen:
        pytest.fail(f"{request.node.nodeid} starts a process ({seen[0]}) but is not marked "
                    "processes (tests/README.md)", pytrace=False)


@pytest.fixture(autouse=True)
def _log_context_cleared() -> Iterator[None]:
    """A test that binds log context (``et_log.bind``: rank, step, attempt) leaves none
    to the next test of the same worker, whose lines would carry it."""
    yield
    structlog.contextvars.clear_contextvars()


# ET_TEST_CPU_REPORT=FILE: one JSON line per test with its wall time and the CPU time of
# the processes it started and reaped (where the suite's time goes: a test whose CPU is
# far below its wall time waits on timers: tests/README.md).
_CPU_REPORT = os.environ.get("ET_TEST_CPU_REPORT")


@pytest.fixture(autouse=True)
def _cpu_report(request: pytest.FixtureRequest) -> Iterator[None]:
    if not _CPU_REPORT:
        yield
        return
    import json
    import resource
    import time

    def used() -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    wall, cpu = time.monotonic(), used()
    yield
    line = {"test": request.node.nodeid, "wall_s": round(time.monotonic() - wall, 2),
            "cpu_s": round(used() - cpu, 2)}
    with open(_CPU_REPORT, "a") as report:
        report.write(json.dumps(line) + "\n")
