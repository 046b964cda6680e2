"""End to end on S3: the real `elastictrain demo` (torchrun, gloo workers, real kills)
with its snapshots in a bucket on moto's server, which the test also crash-stops in
the middle of an upload. Credentials are fake and distinctive; every output, event
file, torchrun log and stored object is searched for them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from elastictrain.core import layout
from tests.helpers import events, run_cli, started, wait_for
from tests.s3server import S3Bucket, assert_no_secret

pytestmark = [pytest.mark.distributed, pytest.mark.s3]


def demo(tmp_path: Path, *args: str, **env: str) -> tuple[dict[str, Any], str]:
    result = run_cli(["demo", "--json", *args], tmp_path, timeout=300,
                     AWS_EC2_METADATA_DISABLED="true", **env)
    assert result.returncode == 0, f"demo failed ({result.returncode}):\n{result.stderr[-4000:]}"
    return dict(json.loads(result.stdout)), result.stdout + result.stderr


def snapshot_dirs(bucket: S3Bucket) -> dict[int, list[str]]:
    """Object names per step under the run's snapshots/, listed fresh from the server."""
    found: dict[int, list[str]] = {}
    for key in bucket.keys("run/snapshots/"):
        step_name, name = key.split("/")[2:4]
        step = layout.parse_step(step_name)
        assert step is not None, key
        found.setdefault(step, []).append(name)
    return found


def assert_committed(names: list[str]) -> None:
    assert len(names) == 2 and layout.MANIFEST in names
    assert layout.is_payload(next(n for n in names if n != layout.MANIFEST))


def assert_nothing_leaked(bucket: S3Bucket, tmp_path: Path, *outputs: str) -> None:
    assert_no_secret(*outputs, where="CLI output")
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert_no_secret(path.read_bytes(), where=str(path))
    client = bucket.server.client()
    for key in bucket.keys(""):
        body = client.get_object(Bucket=bucket.name, Key=key)["Body"].read()
        assert_no_secret(body, where=f"s3://{bucket.name}/{key}")


def test_demo_on_s3_survives_a_kill_and_falls_back_past_a_missing_object(
        s3: S3Bucket, tmp_path: Path) -> None:
    env = {"ELASTICTRAIN_STORAGE__STORAGE_OPTIONS": json.dumps(s3.options)}
    args = [f"--storage={s3.url()}", f"--events-dir={tmp_path / 'events'}", "--steps=60",
            "--snapshot-every=10"]
    first, out1 = demo(tmp_path, *args, "--kill-at=34", **env)
    assert first["restarts"] == 1 and first["resumed_from"] == [None, 30]
    assert first["lost_steps"] == 4 and first["final_step"] == 60
    assert first["storage"] == s3.url()
    # The workers' storage is named on the command line: the standby preloaded s3fs.
    ready = events(tmp_path / "events", "agent.standby_ready")
    assert ready and all("s3fs" in e["modules"] for e in ready), ready
    assert {30, 40, 50, 60} <= set(first["committed_steps"])
    stored = snapshot_dirs(s3)
    assert sorted(stored) == [40, 50, 60]  # keep=3
    for names in stored.values():
        assert_committed(names)

    # The newest manifest now names an object that is gone: resume falls back to 50.
    payload = next(n for n in stored[60] if n != layout.MANIFEST)
    s3.server.client().delete_object(Bucket=s3.name, Key=f"run/{layout.step_dir(60)}/{payload}")
    second, out2 = demo(tmp_path, *args, **env)
    assert second["resumed_from"] == [50] and second["final_step"] == 60
    corrupt = [e for e in events(Path(second["events_dir"]), "snapshot.corrupt")
               if e["rank"] == 0]  # every rank verifies what it reads and logs its own
    assert [e["snapshot_step"] for e in corrupt] == [60, 60]  # discovery, then the re-save
    assert second["param_digest"] == first["param_digest"]
    assert_committed(snapshot_dirs(s3)[60])
    assert_nothing_leaked(s3, tmp_path, out1, out2)


def test_server_outage_mid_upload_loses_that_snapshot_only(s3: S3Bucket,
                                                           tmp_path: Path) -> None:
    """The server crashes while step 40's payload is being uploaded: nothing of step 40
    is committed while it is down, training goes on, and once the server is back
    (same port, same buckets) the background retry commits step 40 and later
    snapshots commit as usual."""
    server = s3.server
    held = server.faults.hold(
        lambda r: r.method == "PUT" and "/step_000000000040/state-" in r.path)
    events_dir = tmp_path / "events"
    endpoint = json.dumps({"client_kwargs": {"endpoint_url": server.endpoint}})
    env = {**s3.env, "ELASTICTRAIN_STORAGE__RETRIES": "1", "AWS_MAX_ATTEMPTS": "1",
           "ELASTICTRAIN_STORAGE__RETRY_BACKOFF_S": "0.1",
           # The persister retries until the server is back, however long that takes.
           "ELASTICTRAIN_SNAPSHOT__MAX_CONSECUTIVE_FAILURES": "1000",
           "ELASTICTRAIN_SNAPSHOT__RETRY_BACKOFF_S": "0.1"}
    cmd = [sys.executable, "-m", "elastictrain.cli", "demo", "--json",
           f"--storage={s3.url()}", f"--storage-options={endpoint}",
           f"--events-dir={events_dir}", "--steps=100", "--snapshot-every=20"]

    def failed(step: int) -> bool:
        return any(e.get("snapshot_step") == step for e in events(events_dir, "snapshot.failed"))

    with started(cmd, tmp_path, "demo.log", **env) as proc:
        assert held.arrived.wait(240), "the upload of step 40 never reached the server"
        before = snapshot_dirs(s3)
        server.stop()
        wait_for(lambda: failed(40), 180, "snapshot.failed for step 40")
        server.start()
        code = proc.wait(timeout=300)
    log = (tmp_path / "demo.log").read_text()
    assert code == 0, log[-4000:]
    out = json.loads(next(line for line in reversed(log.splitlines()) if line.startswith("{")))
    assert sorted(before) == [20]  # nothing of step 40 reached the bucket before the crash
    assert out["restarts"] == 0 and out["final_step"] == 100
    assert out["committed_steps"] == [20, 40, 60, 80, 100]  # 40 by its retry
    failures = [e for e in events(events_dir, "snapshot.failed") if e["snapshot_step"] == 40]
    assert failures and all(e["will_retry"] for e in failures)
    assert s3.url() in failures[0]["error"] and "endpoint is reachable" in failures[0]["error"]
    assert events(events_dir, "storage.retry")
    stored = snapshot_dirs(s3)
    assert sorted(stored) == [60, 80, 100]
    for names in stored.values():
        assert_committed(names)
    assert_nothing_leaked(s3, tmp_path, log)


def test_bad_bucket_stops_the_demo_before_any_worker(s3: S3Bucket, tmp_path: Path) -> None:
    result = run_cli(["demo", "--storage=s3://no-such-bucket/run", "--steps=5",
                      f"--events-dir={tmp_path / 'events'}"], tmp_path, timeout=120,
                     ELASTICTRAIN_STORAGE__STORAGE_OPTIONS=json.dumps(s3.options))
    assert result.returncode == 1
    assert "bucket 'no-such-bucket' does not exist (NoSuchBucket)" in result.stderr
    assert not (tmp_path / "events").exists()  # failed before any worker started
    assert_no_secret(result.stdout, result.stderr)
