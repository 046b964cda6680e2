"""``elastictrain snapshots`` through the real CLI (a child process): a missing step lists
the steps there (exit 2), a directory without a manifest is ``partial``, a file or a
mistyped URL is refused in one line, and inspect prints no Python reprs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastictrain.core.errors import EXIT_USAGE
from elastictrain.storage.locations import check_location
from tests.helpers import run_cli
from tests.unit.view.test_snapshot_cli_messages import PARTIAL_STEP, _run_root


@pytest.mark.processes
def test_a_missing_step_lists_the_steps_there_for_inspect_and_verify(tmp_path: Path) -> None:
    root = _run_root(tmp_path)
    expected = (f"elastictrain: error: no snapshot of step 7 under {root}; steps there, "
                "newest first: 15 (partial), 10, 5; fix: pass one of them with --step")
    for action in ("inspect", "verify"):
        result = run_cli(["snapshots", action, str(root), "--step", "7"], tmp_path)
        assert result.returncode == EXIT_USAGE and result.stdout == ""
        assert result.stderr.strip() == expected, action
        assert "partial write" not in result.stderr


@pytest.mark.processes
def test_a_directory_without_manifest_is_partial_in_list_and_verify(tmp_path: Path) -> None:
    root = _run_root(tmp_path)
    listed = run_cli(["snapshots", "list", str(root), "--json"], tmp_path)
    verified = run_cli(["snapshots", "verify", str(root), "--json"], tmp_path)
    assert listed.returncode == 0, listed.stderr
    # A partial snapshot is no corruption: restore skips it, and the others verify.
    assert verified.returncode == 0, verified.stderr
    statuses = [[(r["step"], r["status"]) for r in json.loads(out.stdout)]
                for out in (listed, verified)]
    assert statuses == [[(15, "partial"), (10, "unverified"), (5, "unverified")],
                        [(15, "partial"), (10, "ok"), (5, "ok")]]
    reasons = {json.loads(out.stdout)[0]["reason"] for out in (listed, verified)}
    assert len(reasons) == 1 and "never committed" in reasons.pop()


@pytest.mark.processes
def test_verify_of_only_a_partial_step_fails(tmp_path: Path) -> None:
    root = _run_root(tmp_path)
    result = run_cli(["snapshots", "verify", str(root), "--step", str(PARTIAL_STEP)],
                     tmp_path)
    assert result.returncode == 1  # nothing there verifies: nothing to resume from
    assert result.stdout.startswith(f"step={PARTIAL_STEP}  status=partial  reason=")


@pytest.mark.processes
@pytest.mark.parametrize(("given", "expected"), [
    ("a-file", "elastictrain: error: storage root a-file: not a directory; fix: pass a "
     "directory (the --storage of demo or run, which holds snapshots/ and events/)"),
    ("s3//bucket/run", "elastictrain: error: storage root 's3//bucket/run' is neither a URL "
     "nor a directory; fix: write the URL with '://', e.g. s3://bucket/run"),
    ("s3:/bucket", "elastictrain: error: storage root 's3:/bucket' is neither a URL nor a "
     "directory; fix: write the URL with '://', e.g. s3://bucket"),
], ids=["file", "s3-no-colon", "s3-one-slash"])
def test_list_refuses_a_file_or_a_mistyped_url_in_one_line(
        tmp_path: Path, given: str, expected: str) -> None:
    (tmp_path / "a-file").write_text("")
    result = run_cli(["snapshots", "list", given], tmp_path)
    assert result.returncode == EXIT_USAGE and result.stdout == ""
    assert result.stderr.strip() == expected
    assert "Errno" not in result.stderr


@pytest.mark.processes
def test_a_directory_named_like_a_url_is_still_a_directory(tmp_path: Path) -> None:
    (tmp_path / "s3" / "bucket").mkdir(parents=True)
    check_location(str(tmp_path / "s3" / "bucket"))
    result = run_cli(["snapshots", "list", "s3//bucket"], tmp_path)
    assert result.returncode == 0 and "no snapshots under s3//bucket" in result.stderr


@pytest.mark.processes
def test_inspect_prints_fields_not_python_reprs(tmp_path: Path) -> None:
    root = _run_root(tmp_path)
    result = run_cli(["snapshots", "inspect", str(root), "--step", "10"], tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "step 10: committed"
    assert "  world_size: 1" in lines and "  signed: no" in lines
    assert "  dataset_len: -" in lines  # not None
    (obj,) = [line for line in lines if line.startswith("    state.pt  ")]
    name, size, unit, algorithm, checksum = obj.split()
    assert (name, unit, algorithm) == ("state.pt", "bytes", "crc32")
    assert int(size) > 0 and int(checksum, 16) >= 0
    assert not any(c in result.stdout for c in "{}[]'") and "None" not in result.stdout
    as_json = run_cli(["snapshots", "inspect", str(root), "--step", "10", "--json"], tmp_path)
    manifest = json.loads(as_json.stdout)  # --json: the manifest as it is, one document
    assert manifest["step"] == 10 and manifest["objects"][0]["name"] == "state.pt"


