"""The container commands of deploy/k8s run as the kubelet runs them: PID 1 of their own
PID namespace, sent SIGTERM while the user's script trains (the README's example in
place of /app/train.py, unmodified, with node memory on as the manifests set it); the
entrypoint maps both preempted exit codes and passes the rest."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, child_env, events, free_port, pid_alive, wait_for
from tests.unit.deploy.test_k8s import (
    ENTRYPOINT,
    _container,
    _env,
    _jobset_job,
    _pytorchjob_pod,
)

pytestmark = [pytest.mark.deploy]
HOOK = REPO / "tests" / "processes" / "e2e" / "user_script_hook"
@pytest.mark.processes
@pytest.mark.parametrize(("code", "expected"), [(75, 138), (76, 138), (78, 78), (1, 1),
                                                (0, 0)])
def test_entrypoint_maps_both_preempted_codes_and_passes_the_rest(code: int,
                                                                  expected: int) -> None:
    as_code = _env(_container(_pytorchjob_pod()["spec"]))["ELASTICTRAIN_EXIT_PREEMPTED_AS"]
    env = {**os.environ, "ELASTICTRAIN_EXIT_PREEMPTED_AS": as_code}
    done = subprocess.run([str(ENTRYPOINT), "sh", "-c", f"exit {code}"], env=env, timeout=30,
                          check=False)
    assert done.returncode == expected


# -- the container command as PID 1 ----------------------------------------------------------
def _local_command(container: dict[str, Any], storage: Path) -> list[str]:
    """The manifest's command here: the README's example as /app/train.py, local storage
    for its S3 URL, one node, a free port."""
    out = []
    for arg in container["command"]:
        if arg == "/usr/local/bin/elastictrain-entrypoint":
            arg = str(ENTRYPOINT)
        elif arg == "/app/train.py":
            arg = str(REPO / "examples" / "ddp_resumable.py")
        elif arg.startswith("s3://"):
            arg = str(storage)
        elif arg.startswith("--nnodes="):
            arg = "--nnodes=1"
        elif arg.startswith("--rdzv-endpoint="):
            arg = f"--rdzv-endpoint=127.0.0.1:{free_port()}"
        out.append(arg)
    return out


@pytest.mark.processes
@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs unshare and root for a PID namespace")
@pytest.mark.parametrize(("manifest", "expected"), [("pytorchjob", 138), ("jobset", 75)])
def test_container_command_as_pid_1_takes_final_snapshot_on_sigterm(
        tmp_path: Path, manifest: str, expected: int) -> None:
    pod_spec = _pytorchjob_pod()["spec"] if manifest == "pytorchjob" else \
        _jobset_job()["spec"]["template"]["spec"]
    container = _container(pod_spec)
    storage = tmp_path / "run"
    env = {k: v for k, v in _env(container).items() if not k.startswith("ELASTICTRAIN_PREEMPT__")
           or k.endswith("GRACE_PERIOD_S")}
    shm = tmp_path / "shm"  # the pod's /dev/shm volume
    shm.mkdir(mode=0o1777)
    # The script's 48 steps would end before the kubelet's SIGTERM: the hook holds every
    # rank after step 12 until the notice (tests/processes/e2e/user_script_hook).
    env.update(ELASTICTRAIN_STORAGE__URL=str(storage), ELASTICTRAIN_SHM=str(shm),
               PYTHONPATH=os.pathsep.join([str(HOOK), str(REPO)]), ET_TEST_PARK_AT="12",
               ET_TEST_PARK_UNTIL_NOTICE="1", ET_TEST_PARK_DIR=str(tmp_path))
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", *_local_command(container, storage)]
    with (tmp_path / "pod.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=child_env(tmp_path, **env), start_new_session=True)
    try:
        ev = storage / "events"
        parked = [tmp_path / f"parked-rank{r}" for r in (0,)]
        wait_for(lambda: proc.poll() is not None or all(p.exists() for p in parked),
                 240, "the script held at step 12")
        assert proc.poll() is None, (tmp_path / "pod.log").read_text(errors="replace")[-3000:]
        pid1 = _namespace_init(proc.pid)
        os.kill(pid1, signal.SIGTERM)  # what the kubelet does on pod deletion
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    log_text = (tmp_path / "pod.log").read_text(errors="replace")
    assert rc == expected, log_text[-3000:]
    saved = [e for e in events(ev, "preempt.saved") if e["rank"] == 0]
    assert saved and saved[0]["within_grace"] is True
    assert any(e["exit_code"] == 75 for e in events(ev, "agent.finished"))
    # Node memory was on (its automatic interval scheduled, its directory in the pod's
    # /dev/shm); its first save comes later than this short run's step 12.
    assert [e for e in events(ev, "snapshot.interval") if e.get("tier") == "memory"]
    assert list(shm.glob("elastictrain-*")), "no node-memory directory in /dev/shm"
    assert not pid_alive(pid1)


def _namespace_init(unshare_pid: int) -> int:
    """The unshare child: PID 1 of the new namespace, the container's process."""
    children = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
    (child,) = children
    return int(child)


