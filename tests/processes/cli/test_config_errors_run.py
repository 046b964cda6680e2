"""A bad setting given to the CLI is one line on stderr, with the fix and never a secret,
before any worker starts."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_cli
from tests.unit.core.test_config_errors import SECRET


# -- the command line: exit code and one line, before any worker starts -------------------
@pytest.mark.processes
@pytest.mark.parametrize(("args", "env", "code", "line"), [
    (["demo", "--keep=0"], {}, 2, "--keep=0: must be >= 1"),
    (["demo"], {"ELASTICTRAIN_SNAPSHOTS__KEEP": "5"}, 2,
     "did you mean ELASTICTRAIN_SNAPSHOT__KEEP"),
    (["demo", "--storage-options={bad"], {}, 2, "--storage-options is not JSON"),
    (["run", "--nproc-per-node=1", "x.py"], {"ELASTICTRAIN_CONFIG": "missing.toml"}, 78,
     "ELASTICTRAIN_CONFIG='missing.toml' does not exist"),
    (["run", "--nproc-per-node=1", "x.py"],
     {"ELASTICTRAIN_STORAGE__STORAGE_OPTIONS": "{" + SECRET}, 78, "is not JSON"),
])
def test_cli_bad_input_is_one_line(tmp_path: Path, args: list[str], env: dict[str, str],
                                   code: int, line: str) -> None:
    (tmp_path / "x.py").write_text("")  # run's script exists: the settings are the error
    result = run_cli([*args, f"--storage={tmp_path / 's'}"] if args[0] == "demo" else args,
                     tmp_path, timeout=120, **env)
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr and SECRET not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and line in lines[0], result.stderr
    assert not (tmp_path / "s" / "events").exists()  # nothing started


