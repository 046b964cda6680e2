"""The hang watchdog in the test's own process: limits, busy sections and the stack dump
(its real exits in a child process: tests/processes/worker/test_watchdog_run.py)."""
from __future__ import annotations

import threading
import time

from structlog.testing import capture_logs

from elastictrain.core.config import WatchdogConfig
from elastictrain.core.errors import EXIT_HANG
from elastictrain.worker import watchdog
from tests.helpers import wait_for


def config(**kw: float) -> WatchdogConfig:
    base = {"timeout_s": 10.0, "startup_timeout_s": 100.0, "check_interval_s": 0.05,
            "backstop": False}
    return WatchdogConfig(**{**base, **kw})


def test_limits_startup_then_step_and_busy_sections_get_the_startup_limit() -> None:
    dog = watchdog.Watchdog(config())
    start = time.monotonic()
    assert dog.limit_s == 100.0 and dog.idle_s(start + 50) is None  # startup limit
    assert dog.idle_s(start + 101) is not None
    dog.beat(1)
    assert dog.limit_s == 10.0
    beat = time.monotonic()
    assert dog.idle_s(beat + 5) is None and dog.idle_s(beat + 11) is not None
    dog.enter_busy("snapshot.restore")
    entered = time.monotonic()
    assert dog.limit_s == 100.0 and dog.idle_s(entered + 50) is None  # long work: no hang
    # ... but not forever: a restore waiting on a peer that never comes is a hang
    # (it used to suspend the watchdog until the collective timeout).
    assert dog.idle_s(entered + 101) is not None
    dog.exit_busy()
    ended = time.monotonic()
    assert dog.idle_s(ended + 5) is None  # the limit counts from the end of the section


def test_busy_is_a_no_op_without_a_watchdog_and_nests() -> None:
    assert watchdog.current() is None
    with watchdog.busy("eval"):
        pass
    dog = watchdog.install(config())
    assert dog is not None
    try:
        with watchdog.busy("a"), watchdog.busy("b"):
            assert dog.idle_s(time.monotonic() + 99) is None
            dog.beat(1)
            assert dog.idle_s(time.monotonic() + 99) is None  # still the section's limit
        assert dog.idle_s(time.monotonic() + 99) is not None  # the step limit again
    finally:
        watchdog.uninstall()
    assert watchdog.current() is None


def test_fires_with_every_threads_stack() -> None:
    exits: list[int] = []
    release = threading.Event()

    def stuck_in_a_collective() -> None:
        release.wait(60)

    worker = threading.Thread(target=stuck_in_a_collective, name="trainer", daemon=True)
    worker.start()
    dog = watchdog.Watchdog(config(timeout_s=0.2), exit_fn=exits.append)
    with capture_logs() as logs:
        dog.start()
        dog.beat(7)
        try:
            wait_for(lambda: bool(exits), 30, "the watchdog to fire")
        finally:
            dog.stop()
            release.set()
    assert exits == [EXIT_HANG]
    fired = [e for e in logs if e["event"] == "watchdog.fired"]
    assert len(fired) == 1 and fired[0]["last_step"] == 7 and fired[0]["phase"] == "step"
    stacks = fired[0]["stacks"]
    trainer = [lines for name, lines in stacks.items() if name.startswith("trainer:")]
    assert trainer and any("stuck_in_a_collective" in line for line in trainer[0])
    assert not any(name.startswith("elastictrain-watchdog") for name in stacks)


