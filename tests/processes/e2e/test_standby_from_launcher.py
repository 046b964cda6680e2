"""The standby forked from the launcher (``standby.client.fork_from_launcher``): under
``elastictrain run`` the launcher imports torch once for itself and its standby, and a
worker forked from that standby still sees what a fresh ``python -u SCRIPT`` would.

The launcher here runs without ``-u`` or ``PYTHONUNBUFFERED`` (output block-buffered,
as a user's shell gives it when redirected), so a worker that inherited the launcher's
streams as they were would show it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastictrain.core.env import LAUNCH_ID_VAR, SHARE_STORE_FIX_VAR
from tests.helpers import child_env, events, kill_session, run_cli

pytestmark = pytest.mark.distributed

# What a worker reports of itself; each line is compared with a fresh interpreter's.
WORKER = """\
    import json, os, sys
    report = {
        "cmdline": open(f"/proc/{os.getpid()}/cmdline", "rb").read().decode(),
        "environ_has_path": b"PATH=" in open(f"/proc/{os.getpid()}/environ", "rb").read(),
        "own_session": os.getsid(0) == os.getpid(),
        "stdout": [type(sys.stdout.buffer).__name__, sys.stdout.write_through],
        "stdin": os.readlink("/proc/self/fd/0"),
        "argv": sys.argv[1:],
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
    }
    with open(sys.argv[1], "w") as f:
        json.dump(report, f)
    sys.exit(int(sys.argv[2]))
"""

# A module the standby preloads: it records the environment it was imported under.
PROBE = f"""\
    import json, os
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump({{"share_fix": os.environ.get("{SHARE_STORE_FIX_VAR}"),
                   "launch_id": os.environ.get("{LAUNCH_ID_VAR}")}}, f)
"""


def test_a_worker_of_a_standby_forked_from_the_launcher_is_a_fresh_interpreter(
        tmp_path: Path) -> None:
    script = tmp_path / "report.py"
    script.write_text(textwrap.dedent(WORKER))
    (tmp_path / "probe_import_env.py").write_text(textwrap.dedent(PROBE))
    out, probed = tmp_path / "report.json", tmp_path / "probed.json"
    env = child_env(tmp_path, PYTHONUNBUFFERED="", PYTHONPATH=str(tmp_path),
                    PROBE_OUT=str(probed), ELASTICTRAIN_LOG__EVENTS_DIR=str(tmp_path / "ev"),
                    ELASTICTRAIN_LAUNCH__STANDBY_PRELOAD=json.dumps(
                        ["torch", "torch.distributed", "probe_import_env"]))
    # A descriptor the launcher inherits from whoever started it: a new interpreter
    # started with Popen would not have it, so neither may the standby's workers.
    read_end, write_end = os.pipe()
    inherited = os.dup2(read_end, 201)
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastictrain.cli", "run", "--no-view", "--nproc-per-node=1",
         "--max-restarts=0", str(script), str(out), "0"],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        pass_fds=(inherited,), start_new_session=True)
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        kill_session(proc)
        for fd in (read_end, write_end, inherited):
            os.close(fd)
    assert proc.returncode == 0, err[-4000:]
    (ready,) = events(tmp_path / "ev", "agent.standby_ready")
    assert ready["from_launcher"] is True and ready["failed"] == {}
    (attempt,) = events(tmp_path / "ev", "agent.attempt_started")
    assert attempt["started_by"] == "standby"

    report = json.loads(out.read_text())
    assert report["cmdline"].split("\0")[0] == f"{sys.executable} -u {script} {out} 0"
    assert report["environ_has_path"]  # the title did not overwrite the environment
    assert report["own_session"]
    assert report["stdout"] == ["FileIO", True]  # unbuffered, as python -u has it
    assert report["stdin"] == "/dev/null"
    assert report["argv"] == [str(out), "0"]
    assert report["fds"][:3] == [0, 1, 2] and inherited not in report["fds"]

    # The preloaded module was imported under the environment the launcher runs with.
    env_at_import = json.loads(probed.read_text())
    assert env_at_import["share_fix"] == "1"
    assert env_at_import["launch_id"] == ready["launch_id"]


def test_a_worker_exit_code_leaves_through_the_launcher_frames(tmp_path: Path) -> None:
    """The forked worker's ``SystemExit`` passes the launcher's frames above the fork
    untouched: its code is the worker's, and the agent sees it as torchrun would."""
    script = tmp_path / "report.py"
    script.write_text(textwrap.dedent(WORKER))
    result = run_cli(["run", "--no-view", "--nproc-per-node=1", "--max-restarts=0",
                      str(script), str(tmp_path / "report.json"), "3"], tmp_path,
                     timeout=240, ELASTICTRAIN_LOG__EVENTS_DIR=str(tmp_path / "ev"))
    assert result.returncode == 1, result.stderr[-4000:]  # a failed worker: exit 1
    failed = events(tmp_path / "ev", "agent.worker_failed")
    assert failed and failed[0]["exit_code"] == 3, failed
    (ready,) = events(tmp_path / "ev", "agent.standby_ready")
    assert ready["from_launcher"] is True
