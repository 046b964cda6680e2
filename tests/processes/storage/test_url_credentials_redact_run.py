"""Commands run as child processes never show a URL's credentials, and refuse a misspelled
scheme before writing anything."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from elastictrain.core.errors import EXIT_USAGE
from tests.helpers import run_cli
from tests.s3server import S3Bucket, assert_no_secret
from tests.unit.storage.test_url_credentials_redact import _with_credentials


def _assert_no_secret_in_files(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            assert_no_secret(path.read_bytes(), where=str(path))


@pytest.mark.processes
@pytest.mark.s3
@pytest.mark.parametrize(("command", "code"), [
    (["snapshots", "list"], EXIT_USAGE),
    (["snapshots", "verify"], EXIT_USAGE),
    (["snapshots", "prune", "--keep", "1"], EXIT_USAGE),
    (["demo", "--steps", "4", "--storage"], EXIT_USAGE),
], ids=["list", "verify", "prune", "demo"])
def test_failing_commands_never_show_a_url_credential(
        s3: S3Bucket, tmp_path: Path, command: list[str], code: int) -> None:
    options = json.dumps({"client_kwargs": {"endpoint_url": s3.server.endpoint}})
    env: dict[str, Any] = dict(s3.env)  # valid credentials: only the URL is wrong
    for bucket in ("nobucket", s3.name):  # a missing bucket, and one that exists
        url = _with_credentials(f"s3://{bucket}/x")
        result = run_cli([*command, url, "--storage-options", options], tmp_path, **env)
        assert result.returncode == code, result.stderr[-3000:]
        assert "has credentials in it" in result.stderr and f"s3://{bucket}/x" in result.stderr
        assert_no_secret(result.stdout, result.stderr, where=f"{command[0]} output")
    _assert_no_secret_in_files(tmp_path)
    assert s3.server.keys(s3.name) == []  # refused before any request wrote anything


@pytest.mark.processes
@pytest.mark.parametrize("command", [["status"], ["snapshots", "list"], ["goodput"],
                                     ["demo", "--steps", "2", "--quiet", "--storage"]],
                         ids=["status", "list", "goodput", "demo"])
def test_commands_refuse_a_misspelled_scheme_before_writing(tmp_path: Path,
                                                            command: list[str]) -> None:
    result = run_cli([*command, "s3//bucket/run"], tmp_path)
    assert result.returncode == EXIT_USAGE, result.stderr[-3000:]
    # The read commands find no such directory; the demo, which would write, refuses it.
    assert "fix: write" in result.stderr and "s3://bucket/run" in result.stderr
    assert not (tmp_path / "s3").exists()


