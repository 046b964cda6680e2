"""The CLI as a child process reaches S3 by every configuration route, and says clearly
when there are no credentials anywhere."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from elastictrain.snapshot.durable.commit import persist_snapshot
from elastictrain.snapshot.format.manifest import SnapshotMeta
from elastictrain.storage import FsspecStore
from tests.helpers import run_cli
from tests.s3server import FAKE_KEY, FAKE_SECRET, S3Bucket, assert_no_secret


def _committed_snapshot(s3: S3Bucket) -> None:
    store = FsspecStore(s3.url(), s3.options)
    import torch

    meta = SnapshotMeta(run_id="cli", step=7, epoch=0, world_size=1,
                        checksum_algorithm="crc32")
    persist_snapshot(store, {"w": torch.ones(8)}, meta)


@pytest.mark.processes
@pytest.mark.s3
@pytest.mark.parametrize("route", ["elastictrain env", "FSSPEC_S3 json", "FSSPEC_S3_* vars",
                                   "--storage-options"])
def test_cli_reaches_s3_by_every_configuration_route(s3: S3Bucket, tmp_path: Path,
                                                     route: str) -> None:
    """`elastictrain snapshots verify` (list, read, check) on a moto bucket, with the
    endpoint and the credentials given each supported way. The default endpoint (AWS) is unreachable
    here, so success proves the configuration was applied."""
    _committed_snapshot(s3)
    endpoint = {"client_kwargs": {"endpoint_url": s3.server.endpoint}}
    env: dict[str, Any] = {"AWS_EC2_METADATA_DISABLED": "true"}
    args: list[str] = []
    if route == "elastictrain env":
        env["ELASTICTRAIN_STORAGE__STORAGE_OPTIONS"] = json.dumps(s3.options)
    elif route == "FSSPEC_S3 json":
        env["FSSPEC_S3"] = json.dumps({**endpoint, "key": FAKE_KEY, "secret": FAKE_SECRET})
    elif route == "FSSPEC_S3_* vars":
        env.update(s3.env, FSSPEC_S3_ENDPOINT_URL=s3.server.endpoint)
    else:
        env.update(s3.env)
        args = ["--storage-options", json.dumps(endpoint)]
    verified = run_cli(["snapshots", "verify", s3.url(), "--json", *args], tmp_path, **env)
    assert verified.returncode == 0, verified.stderr[-3000:]
    assert_no_secret(verified.stdout, verified.stderr, where=f"CLI output ({route})")
    assert [(r["step"], r["status"]) for r in json.loads(verified.stdout)] == [(7, "ok")]


@pytest.mark.processes
@pytest.mark.s3
def test_no_credentials_anywhere_is_a_clear_error(s3: S3Bucket, tmp_path: Path) -> None:
    nowhere = str(tmp_path / "none")
    env: dict[str, Any] = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "",
                           "AWS_SESSION_TOKEN": "", "AWS_SHARED_CREDENTIALS_FILE": nowhere,
                           "AWS_CONFIG_FILE": nowhere, "AWS_EC2_METADATA_DISABLED": "true"}
    options = json.dumps({"client_kwargs": {"endpoint_url": s3.server.endpoint}})
    result = run_cli(["snapshots", "list", s3.url(), "--storage-options", options], tmp_path,
                     **env)
    # 1, a storage error: 78 (fatal, do not retry) is for runs, not for a command reading one
    assert result.returncode == 1, result.stderr[-3000:]
    assert "no usable S3 credentials were found" in result.stderr
    assert f"{s3.url()}/snapshots" in result.stderr and "AWS_ACCESS_KEY_ID" in result.stderr


