"""S3 beyond the contract: fresh listings, conditional writes, transient faults retried
with backoff, and the faults a user must fix failing at once with a clear message.

Faults are real HTTP answers (503 SlowDown, cut connections, 501) from the test
server in front of moto; credentials are checked by moto's own IAM emulation.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from elastictrain.core import log as et_log
from elastictrain.core.errors import (
    EXIT_FATAL,
    StorageConflictError,
    StorageNotFoundError,
    StoragePermissionError,
)
from elastictrain.runlog.events_read import read_events
from elastictrain.storage import FsspecStore
from tests.s3server import FAKE_KEY, FAKE_SECRET, Request, S3Bucket, assert_no_secret

pytestmark = pytest.mark.s3

MIB = 2**20
# botocore's own per-request retries off, so the counts below are elastictrain's and s3fs's.
ONE_ATTEMPT = {"config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 1}}}


def s3_store(bucket: S3Bucket, url: str | None = None, options: dict[str, Any] | None = None,
             **kwargs: Any) -> FsspecStore:
    settings = {"retries": 2, "retry_backoff_s": 0.05, **kwargs}
    return FsspecStore(url or bucket.url(), {**bucket.options, **(options or {})}, **settings)


def put_of(name: str) -> Callable[[Request], bool]:
    return lambda r: r.op == "PutObject" and r.path.endswith("/" + name)


def test_stale_listing_cache_cannot_hide_a_new_step(s3: S3Bucket) -> None:
    store = s3_store(s3)
    store.write_bytes("snapshots/step_000000000010/MANIFEST.json", b"{}")
    assert store.list_dir("snapshots") == ["step_000000000010"]
    other = s3_store(s3, options={"skip_instance_cache": True})  # another process, in effect
    other.write_bytes("snapshots/step_000000000020/MANIFEST.json", b"{}")
    # The trap: s3fs answers from the listing it cached, without the new step.
    cached = store.fs.ls(f"{store.root}/snapshots", detail=False)
    assert [p.rsplit("/", 1)[1] for p in cached] == ["step_000000000010"]
    assert store.list_dir("snapshots") == ["step_000000000010", "step_000000000020"]


def test_create_only_write_sends_if_none_match(s3: S3Bucket) -> None:
    store = s3_store(s3)
    store.write_bytes("MANIFEST.json", b"first", if_absent=True)
    with pytest.raises(StorageConflictError, match="already exists"):
        store.write_bytes("MANIFEST.json", b"second", if_absent=True)
    puts = s3.server.faults.seen(put_of("MANIFEST.json"))
    assert [(p.if_none_match, p.status) for p in puts] == [("*", 200), ("*", 412)]
    assert store.read_bytes("MANIFEST.json") == b"first"


def test_store_without_conditional_writes_falls_back(s3: S3Bucket) -> None:
    """An S3-compatible store that answers If-None-Match with 501 still works."""
    s3.server.faults.error(lambda r: r.if_none_match == "*", 501, "NotImplemented",
                           "A header you provided implies functionality that is not "
                           "implemented", times=100)
    store = s3_store(s3)
    with capture_logs() as logs:
        store.write_bytes("MANIFEST.json", b"first", if_absent=True)
        with pytest.raises(StorageConflictError):
            store.write_bytes("MANIFEST.json", b"second", if_absent=True)
    assert store.read_bytes("MANIFEST.json") == b"first"
    assert [e["event"] for e in logs if e["event"].startswith("storage.")] == [
        "storage.conditional_put_unsupported"]
    assert not store.supports_conditional_put


@pytest.mark.parametrize("fault,times", [("throttle", 12), ("cut", 7)])
def test_transient_faults_are_retried_with_backoff(s3: S3Bucket, fault: str,
                                                    times: int) -> None:
    """Many failures in a row: s3fs absorbs some (up to 5 SlowDowns in a row; cut
    connections only sometimes), elastictrain's policy retries the operation until it
    succeeds, with growing, jittered delays."""
    match = put_of("obj.bin")
    if fault == "throttle":
        s3.server.faults.throttle(match, times=times)
    else:
        s3.server.faults.drop(match, times=times)
    # A real backoff (1 s, doubling, capped at 20 s), waited on the test's clock: the
    # waits are read, not slept.
    waits: list[float] = []
    store = s3_store(s3, options=ONE_ATTEMPT, retries=8, retry_backoff_s=1.0,
                     retry_sleep=waits.append)
    with capture_logs() as logs:
        store.write_bytes("obj.bin", b"payload")
    assert store.read_bytes("obj.bin") == b"payload"
    statuses = [r.status for r in s3.server.faults.seen(match)]
    assert len(statuses) == times + 1 and statuses[-1] == 200
    retries = [e for e in logs if e["event"] == "storage.retry"]
    assert len(retries) <= 8 and all(e["op"] == "write" for e in retries)
    assert all(e["path"] == s3.url() + "/obj.bin" for e in retries)
    assert [round(w, 3) for w in waits] == [e["delay_s"] for e in retries]
    assert all(0.5 * min(2**i, 20) <= w <= min(2**i, 20) for i, w in enumerate(waits))
    if fault == "throttle":  # s3fs stops after 5 SlowDowns: the rest were ours
        assert len(retries) >= 2 and {e["error_code"] for e in retries} == {"SlowDown"}


def test_a_failing_part_is_retried_alone(s3: S3Bucket) -> None:
    part2 = lambda r: r.op == "UploadPart" and r.part == 2  # noqa: E731
    s3.server.faults.throttle(part2, times=7)
    waits: list[float] = []
    store = s3_store(s3, options=ONE_ATTEMPT, retries=3, part_size_bytes=5 * MIB,
                     multipart_threshold_bytes=5 * MIB, upload_concurrency=2,
                     retry_sleep=waits.append)
    data = bytes(range(256)) * (11 * MIB // 256)
    with store.open_write("big.bin") as f:
        f.write(data)
    assert store.read_bytes("big.bin") == data
    parts = [r.part for r in s3.server.faults.seen(lambda r: r.op == "UploadPart")]
    assert (parts.count(1), parts.count(2), parts.count(3)) == (1, 8, 1)
    assert waits and all(w <= 0.05 * 2**2 for w in waits)  # 3 retries a try, from 0.05 s


def test_missing_bucket_fails_at_once_with_the_fix(s3: S3Bucket) -> None:
    store = s3_store(s3, url="s3://no-such-bucket/run", retries=5)
    with capture_logs() as logs, pytest.raises(StorageNotFoundError) as info:
        store.check_writable()
    message = str(info.value)
    assert "bucket 'no-such-bucket' does not exist (NoSuchBucket)" in message
    assert "s3://no-such-bucket/run/" in message and "fix: create the bucket" in message
    assert len(s3.server.faults.seen(lambda r: r.path.startswith("/no-such-bucket"))) == 1
    assert not [e for e in logs if e["event"] == "storage.retry"]
    # Listing a missing bucket is an error, not "no snapshots yet".
    with pytest.raises(StorageNotFoundError, match="does not exist"):
        store.list_dir("snapshots")
    assert_no_secret(message, repr(logs))


@pytest.fixture
def iam_key(s3: S3Bucket) -> tuple[str, str]:
    """A moto IAM user with an access key and no permissions; moto then checks every
    request's credentials (the fixture turns that off again)."""
    iam = s3.server.client("iam")
    iam.create_user(UserName="trainer")
    key = iam.create_access_key(UserName="trainer")["AccessKey"]
    s3.server.require_auth(True)
    return str(key["AccessKeyId"]), str(key["SecretAccessKey"])


@pytest.mark.parametrize("case,code,needle", [
    ("unknown key", "InvalidAccessKeyId", "rejected the credentials"),
    ("wrong secret", "SignatureDoesNotMatch", "rejected the credentials"),
    ("no permission", "AccessDenied", "access denied"),
])
def test_rejected_credentials_fail_at_once(s3: S3Bucket, iam_key: tuple[str, str], case: str,
                                           code: str, needle: str) -> None:
    key_id, secret = iam_key
    key, used_secret = {"unknown key": (FAKE_KEY, FAKE_SECRET),
                        "wrong secret": (key_id, FAKE_SECRET),
                        "no permission": (key_id, secret)}[case]
    store = s3_store(s3, options={"key": key, "secret": used_secret}, retries=5)
    with capture_logs() as logs, pytest.raises(StoragePermissionError) as info:
        store.check_writable()
    message = str(info.value)
    assert f"{needle} ({code}); fix:" in message and f"{s3.url()}/" in message
    assert info.value.exit_code == EXIT_FATAL
    assert len(s3.server.faults.seen(lambda r: r.method == "PUT")) == 1  # not retried
    assert not [e for e in logs if e["event"] == "storage.retry"]
    assert_no_secret(message, repr(logs))
    assert key_id not in message and secret not in message


def test_retry_events_from_upload_threads_carry_the_run_context(s3: S3Bucket,
                                                                tmp_path: Path) -> None:
    """Parts upload in worker threads; their events still say which run and rank."""
    s3.server.faults.throttle(lambda r: r.op == "UploadPart" and r.part == 2, times=6)
    store = s3_store(s3, options=ONE_ATTEMPT, retries=3, part_size_bytes=5 * MIB,
                     multipart_threshold_bytes=5 * MIB, upload_concurrency=2,
                     retry_sleep=lambda s: None)
    events_file = tmp_path / "events.jsonl"
    et_log.configure("warning", json_output=True, events_file=events_file,
                     stream=io.StringIO())
    et_log.bind(run_id="run-ctx", rank=0)
    try:
        with store.open_write("big.bin") as f:
            f.write(b"\0" * (11 * MIB))
    finally:
        structlog.contextvars.clear_contextvars()
        structlog.reset_defaults()
    retries = [e for e in read_events(events_file) if e["event"] == "storage.retry"]
    assert retries and all(e["run_id"] == "run-ctx" and e["rank"] == 0 for e in retries)
