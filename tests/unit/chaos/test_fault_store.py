"""The fault-injecting store does what its configuration says, on memory:// and local."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from elastictrain.core.config import FaultsConfig, load_settings
from elastictrain.core.errors import ConfigError, StorageTransientError
from elastictrain.storage import Store, open_store
from elastictrain.storage.faults import FaultyStore

PAYLOAD = "snapshots/step_000000000010/state.pt"


@pytest.fixture(params=["local", "memory"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "run")
    else:
        yield f"memory://faults-{os.getpid()}-{id(request)}"


def faulty(url: str, **faults: object) -> Store:
    settings = load_settings(storage={"url": url, "faults": faults})
    return open_store(settings.storage)


def test_no_faults_configured_means_no_wrapper(url: str) -> None:
    assert not isinstance(open_store(load_settings(storage={"url": url}).storage), FaultyStore)


def test_faults_from_the_environment_wrap_the_store(url: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTICTRAIN_STORAGE__FAULTS", '{"write_error_p": 1.0}')
    store = open_store(load_settings(storage={"url": url}).storage)
    assert isinstance(store, FaultyStore)
    with pytest.raises(StorageTransientError, match="injected fault"):
        store.write_bytes("a", b"x")


def test_certain_errors_fail_every_operation_of_their_kind(url: str) -> None:
    reads_fail = faulty(url, read_error_p=1.0)
    reads_fail.write_bytes("a", b"hello")  # writes are untouched
    with capture_logs() as logs:
        for op in (lambda: reads_fail.read_bytes("a"), lambda: reads_fail.list_dir(""),
                   lambda: reads_fail.exists("a"), lambda: reads_fail.size("a")):
            with pytest.raises(StorageTransientError, match="injected fault"):
                op()
    assert [e["op"] for e in logs if e["event"] == "storage.fault_injected"] == [
        "read", "list", "stat", "stat"]
    writes_fail = faulty(url, write_error_p=1.0)
    assert writes_fail.read_bytes("a") == b"hello"
    with pytest.raises(StorageTransientError):
        writes_fail.write_bytes("b", b"x")
    with pytest.raises(StorageTransientError):
        writes_fail.delete("a")
    assert not open_store(url).exists("b") and open_store(url).exists("a")


def test_error_probability_is_roughly_respected(url: str) -> None:
    store = faulty(url, read_error_p=0.3, seed=5)
    store.inner.write_bytes("a", b"x")  # type: ignore[attr-defined]
    failures = 0
    for _ in range(400):
        try:
            store.read_bytes("a")
        except StorageTransientError:
            failures += 1
    assert 60 < failures < 180


def test_crash_mid_upload_writes_nothing_then_lets_later_writes_through(url: str) -> None:
    store = faulty(url, crash_after_bytes=100, crash_writes=1)
    with pytest.raises(StorageTransientError, match="crash mid-upload"), \
            store.open_write(PAYLOAD) as sink:
        sink.write(b"x" * 60)
        sink.write(b"y" * 60)  # crosses byte 100
    assert not open_store(url).exists(PAYLOAD)
    with store.open_write(PAYLOAD) as sink:  # the one crash is spent
        sink.write(b"z" * 500)
    assert open_store(url).read_bytes(PAYLOAD) == b"z" * 500
    with store.open_write("notes.txt") as sink:  # only payloads ever crash
        sink.write(b"n" * 500)


def test_latency_is_added_to_each_operation(url: str) -> None:
    import time

    store = faulty(url, latency_s=0.05)
    started = time.monotonic()
    for _ in range(4):
        store.exists("a")
    assert time.monotonic() - started >= 0.2  # a lower bound: never flaky under load


def test_the_fault_generator_leaves_the_global_random_stream_alone(url: str) -> None:
    import random

    random.seed(3)
    expected = random.random()
    random.seed(3)
    store = faulty(url, read_error_p=0.5)
    for _ in range(20):
        with contextlib.suppress(StorageTransientError):
            store.exists("a")
    assert random.random() == expected


def test_config_rejects_a_probability_above_one() -> None:
    with pytest.raises(ConfigError, match=r"storage\.faults\.read_error_p=1\.5"):
        load_settings(storage={"faults": FaultsConfig().model_dump() | {"read_error_p": 1.5}})
