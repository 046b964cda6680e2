"""``elastictrain rendezvous-store``: with the c10d store in a process of its own, the
node that started first (which would otherwise host the store) can be lost.

Three agents of one worker each under ``elastictrain run`` meet at the store process;
the first agent's whole tree is SIGKILLed after the snapshot of step 10 committed, a
replacement joins, and the job ends at 3 ranks on the digest of a 3-rank run that lost
nothing (the README's example; snapshots restore DDP's bucket layout, so the restart is
bit-exact above two ranks). Then the store stops on SIGTERM with exit 0, and a second
store on a taken port exits 1 naming it."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, child_env, events, free_port, kill_tree
from tests.processes.multinode.test_two_agents import port_open, wait_until

pytestmark = pytest.mark.distributed

EXAMPLE = REPO / "examples" / "ddp_resumable.py"


def _store(tmp_path: Path, port: int, name: str) -> subprocess.Popen[bytes]:
    with open(tmp_path / f"{name}.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "elastictrain.cli", "rendezvous-store",
                                 "--host", "127.0.0.1", "--port", str(port)], stdout=log,
                                stderr=subprocess.STDOUT, cwd=tmp_path,
                                env=child_env(tmp_path), start_new_session=True)


def _agent(tmp_path: Path, port: int, storage: Path, name: str, nnodes: str
           ) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "elastictrain.cli", "run", "--no-view",
               "--nproc-per-node", "1", "--nnodes", nnodes, "--max-restarts", "3",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", f"store-{port}", str(EXAMPLE), str(storage)]
    with open(tmp_path / f"{name}.log", "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                                env=child_env(tmp_path, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
                                start_new_session=True)


def _digest(storage: Path) -> str:
    (done,) = [e for e in events(storage / "events", "run.finished") if e.get("role") != "agent"]
    return str(done["param_digest"])


@pytest.mark.timeout(600)
def test_the_first_node_is_lost_and_the_job_ends_right(tmp_path: Path) -> None:
    port = free_port()
    store = _store(tmp_path, port, "store")
    procs: list[subprocess.Popen[bytes]] = [store]
    try:
        wait_until(lambda: port_open(port) or store.poll() is not None, 60, "the store")
        assert store.poll() is None, (tmp_path / "store.log").read_text()
        # The reference: one agent of 3 workers, its own store, nothing lost.
        reference = subprocess.Popen(
            [sys.executable, "-m", "elastictrain.cli", "run", "--no-view",
             "--nproc-per-node", "3", str(EXAMPLE), str(tmp_path / "reference")],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=tmp_path,
            env=child_env(tmp_path), start_new_session=True)
        procs.append(reference)
        storage = tmp_path / "storage"
        agents = [_agent(tmp_path, port, storage, f"node{i}", "3") for i in range(3)]
        procs += agents
        committed = storage / "snapshots" / "step_000000000010" / "MANIFEST.json"
        wait_until(lambda: committed.exists() or any(a.poll() is not None for a in agents),
                   240, "the snapshot of step 10")
        first = agents[0]
        kill_tree(first.pid)  # the node that started first: no longer special
        first.wait(timeout=30)
        replacement = _agent(tmp_path, port, storage, "node3", "3")
        procs.append(replacement)
        codes = [a.wait(timeout=300) for a in (*agents[1:], replacement)]
        logs = "\n".join((tmp_path / f"node{i}.log").read_text()[-2000:] for i in range(4))
        assert codes == [0, 0, 0], logs
        assert reference.wait(timeout=300) == 0
        resumed = [e for e in events(storage / "events", "resume") if e.get("from_step")]
        assert resumed and {e["world_size"] for e in resumed} == {3}, resumed
        assert _digest(storage) == _digest(tmp_path / "reference")
        assert store.poll() is None  # the store outlived every node of the job
        taken = _store(tmp_path, port, "taken")
        procs.append(taken)
        assert taken.wait(timeout=60) == 1
        assert f"cannot serve 127.0.0.1:{port}" in (tmp_path / "taken.log").read_text()
        store.send_signal(signal.SIGTERM)
        assert store.wait(timeout=30) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait(timeout=30)
