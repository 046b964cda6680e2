"""The backend a store gets is picked by protocol, and decides which faults are retried."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from elastictrain.storage import FsspecStore
from elastictrain.storage.backends import backend_for, is_transient
from elastictrain.storage.generic import Backend, MemoryBackend
from elastictrain.storage.local import LocalBackend
from elastictrain.storage.retry import RetryPolicy
from elastictrain.storage.s3 import S3Backend


class _ClientError(Exception):
    """What botocore raises for an S3 error answer: the code is in ``response``."""

    def __init__(self, code: str, status: int) -> None:
        super().__init__(code)
        self.response = {"Error": {"Code": code},
                         "ResponseMetadata": {"HTTPStatusCode": status}}


class ServerDisconnectedError(Exception):
    """Named as aiohttp's: known by class name, without importing aiohttp."""


@pytest.mark.parametrize(("protocol", "backend"), [
    ("file", LocalBackend), (("file", "local"), LocalBackend), (("s3", "s3a"), S3Backend),
    ("s3a", S3Backend), ("memory", MemoryBackend), (("gs", "gcs"), Backend),
    ("az", Backend),
])
def test_the_backend_is_picked_by_protocol(protocol: str | tuple[str, ...],
                                           backend: type[Backend]) -> None:
    assert backend_for(protocol) is backend


# The memory backend's reading of faults, as a store of it hands them to the policy.
MEMORY = {"transient": backend_for("memory").is_transient,
          "error_code": backend_for("memory").error_code}

def test_a_store_uses_its_protocols_backend(tmp_path: Path) -> None:
    local = FsspecStore(str(tmp_path))
    assert type(local.backend) is LocalBackend
    assert local.supports_rename and local.local_path("a") == str(tmp_path / "a")
    memory = FsspecStore("memory://backend-pick")
    assert type(memory.backend) is MemoryBackend
    assert not memory.supports_rename and memory.supports_conditional_put
    assert memory.local_path("a") is None


def test_s3_error_codes_count_only_on_s3() -> None:
    throttled = _ClientError("SlowDown", 503)
    assert is_transient(throttled, ("s3", "s3a"))
    assert not is_transient(throttled, "memory")  # not an OSError: the generic rules say no
    assert not is_transient(_ClientError("AccessDenied", 403), "s3")


def test_generic_rules_hold_on_every_protocol() -> None:
    for protocol in ("file", "memory", "s3", "gs"):
        assert is_transient(OSError(errno.ETIMEDOUT, "timed out"), protocol)
        assert is_transient(ServerDisconnectedError(), protocol)
        assert not is_transient(FileNotFoundError(errno.ENOENT, "gone"), protocol)
        assert not is_transient(ValueError("bad"), protocol)


def test_a_storage_policy_retries_with_jitter_a_persist_policy_without() -> None:
    storage = RetryPolicy.for_storage(retries=5, backoff_s=0.2)
    assert (storage.max_consecutive_failures, storage.retries) == (6, 5)
    assert 0.1 <= storage.delay_s(1) <= 0.2
    assert 10.0 <= storage.delay_s(20) <= 20.0  # capped
    persist = RetryPolicy(max_consecutive_failures=3, backoff_s=0.5)
    assert [persist.delay_s(k) for k in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert persist.delay_s(20) == 30.0


def test_run_stops_at_a_permanent_fault_and_after_the_last_retry() -> None:
    waits: list[float] = []
    policy = RetryPolicy.for_storage(retries=2, backoff_s=4.0, sleep=waits.append)
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise TimeoutError("slow")
        return "ok"

    assert policy.run(flaky, op="read", where="x", **MEMORY) == ("ok", 2)
    # Two waits through the policy's clock, jittered within their backoff (none real).
    assert len(waits) == 2 and 2.0 <= waits[0] <= 4.0 and 4.0 <= waits[1] <= 8.0

    def denied() -> None:
        calls.append(1)
        raise PermissionError(errno.EACCES, "denied")

    calls.clear()
    with pytest.raises(PermissionError) as info:
        policy.run(denied, op="read", where="x", **MEMORY)
    assert len(calls) == 1 and info.value.retries_used == 0  # type: ignore[attr-defined]

    def down() -> None:
        calls.append(1)
        raise ConnectionResetError(errno.ECONNRESET, "reset")

    calls.clear()
    with pytest.raises(ConnectionResetError) as info_down:
        policy.run(down, op="read", where="x", **MEMORY)
    assert len(calls) == 3 and info_down.value.retries_used == 2  # type: ignore[attr-defined]
