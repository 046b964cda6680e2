"""The ``elastictrain`` command as a child process: ``run --help`` shows the defaults in
effect, a missing script is one line before any worker starts, and bad input exits 2 on
every command."""
from __future__ import annotations

from pathlib import Path

import pytest

from elastictrain.chaos.runner import ChaosOptions
from elastictrain.core.errors import EXIT_USAGE, ConfigError
from tests.helpers import REPO, run_cli


@pytest.mark.processes
def test_run_help_shows_the_defaults_in_effect(tmp_path: Path) -> None:
    result = run_cli(["run", "--help"], tmp_path, timeout=120,
                     ELASTICTRAIN_LAUNCH__SHUTDOWN_TIMEOUT_S="120")
    assert result.returncode == 0, result.stderr
    assert "default, elastictrain: 120;" in " ".join(result.stdout.split())


@pytest.mark.processes
def test_run_with_a_script_that_does_not_exist_is_one_line_before_any_worker(
        tmp_path: Path) -> None:
    result = run_cli(["run", "--nproc-per-node=2", "missing.py", "--lr=1"], tmp_path,
                     timeout=120)
    assert result.returncode == EXIT_USAGE
    assert result.stderr.strip() == (
        f"elastictrain run: error: script 'missing.py' does not exist (relative to "
        f"{tmp_path}); fix: check the path of the training script")
    # Nothing started: no event log, no torchrun temp dir (TMPDIR is tmp_path).
    assert list(tmp_path.iterdir()) == [] and result.stdout == ""


@pytest.mark.processes
def test_chaos_refuses_a_command_without_the_storage_placeholder(tmp_path: Path) -> None:
    script = str(REPO / "examples" / "ddp_resumable.py")
    with pytest.raises(ConfigError, match=r"no \{storage\}.*fix: write \{storage\}"):
        ChaosOptions(script=script, script_args=["./ck"]).validate()
    ChaosOptions(script=script, script_args=["{storage}"]).validate()
    ChaosOptions(script=script, script_args=["--dir={storage}/ck"]).validate()
    ChaosOptions().validate()  # the built-in demo takes no command
    result = run_cli(["chaos", "--trials", "3", "--", script, "./ck"], tmp_path, timeout=120)
    assert result.returncode == EXIT_USAGE
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "{storage}" in lines[0], lines
    assert not (tmp_path / "ck").exists()


@pytest.mark.processes
@pytest.mark.parametrize("args", [
    ["snapshots", "list", "a-file"],
    ["snapshots", "verify", "s3//bucket"],
    ["snapshots", "prune", "nowhere", "--keep", "1"],
    ["snapshots", "list", ".", "--storage-options", "["],
    ["status", "nowhere"],
    ["goodput", "nowhere"],
    ["demo", "--steps", "0"],
    ["chaos", "--trials", "-1"],
    ["chaos", "--", "missing.py", "{storage}"],
    ["rendezvous-store", "--port", "70000"],
    ["snapshots", "list"],
], ids=lambda a: " ".join(a))
def test_bad_input_exits_2_on_every_command(tmp_path: Path, args: list[str]) -> None:
    (tmp_path / "a-file").write_text("")
    result = run_cli(args, tmp_path, timeout=120)
    assert result.returncode == EXIT_USAGE, result.stderr
    assert "Traceback" not in result.stderr


