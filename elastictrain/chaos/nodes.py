"""A job of several agents ("nodes") on this machine, and the loss of one of them.

Each node is an ``elastictrain run`` launcher (a :class:`~elastictrain.chaos.job.Job`)
with its own work directory, event log and stand-in for ``/dev/shm``
(``<trial>/nodeI.K/``, found by its workers through ``ELASTICTRAIN_SHM``: its memory
directory and rescue marks are its own). All of them share the trial's durable storage
and join one c10d rendezvous whose store runs in a process of its own
(:mod:`.rdzvstore`), so any node may be lost.

Losing a node: every process of the node (launcher, standby, workers, persist
processes) is found by its marker (``ETCHAOS_RUN=<trial>/nodeI.K/<launch>``, inherited
by every child whatever session or process group it starts) and SIGSTOPped, the scan
repeated until it finds no process it has not stopped (a fork meanwhile), then each is
SIGKILLed, and the node's memory directory is wiped. The marker rather than a process
group: torchrun starts its workers in sessions of their own. Rather than a PID
namespace per node: the agents and workers log their PIDs as this machine sees them,
and the harness signals workers by those PIDs. A "silent" loss waits between the stop
and the kill, so the other nodes meet a peer that answers nothing (a machine gone), not
the connection resets that processes killed on a live kernel send.

A replacement is a new launcher, ``nodeI.K+1``, with an empty memory directory.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from elastictrain.chaos.job import MARKER_VAR, Job, processes_with_marker, signal_pid
from elastictrain.core.env import SHM_VAR
from elastictrain.core.proc import PROC, stat_fields
from elastictrain.core.shm import user_root_in
from elastictrain.launcher.spawn import LaunchSpec

_POLL_S = 0.05
STOP_WAIT_S = 5.0  # for every thread of a SIGSTOPped node to stop
_HALTED = ("T", "t", "Z", "X")  # stopped, traced, zombie, dead
STORE_START_S = 60.0


@dataclass
class Node:
    """One incarnation of a node: index ``index``, the ``incarnation``-th agent there."""

    index: int
    incarnation: int
    job: Job
    shm: Path
    started_ts: float = 0.0
    lost_ts: float | None = None  # when the harness froze or killed it

    @property
    def name(self) -> str:
        return f"node{self.index}.{self.incarnation}"

    @property
    def running(self) -> bool:
        return self.lost_ts is None and self.job.poll() is None


class RendezvousStore:
    """The rendezvous store process (:mod:`.rdzvstore`); ``port`` once it listens."""

    def __init__(self, workdir: Path, marker: str, env: dict[str, str]) -> None:
        port_file = workdir / "rdzv.port"
        self.log = open(workdir / "rdzv.log", "wb")  # noqa: SIM115 - closed by close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "elastictrain.chaos.rdzvstore", str(port_file)],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**env, MARKER_VAR: f"{marker}/rdzv"})
        deadline = time.monotonic() + STORE_START_S
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the rendezvous store did not start; see {workdir}/rdzv.log")
            time.sleep(_POLL_S)  # polling for the file the store writes when it listens
        self.port = int(port_file.read_text())

    def close(self) -> None:
        signal_pid(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()


@dataclass
class NodeJob:
    """The agents of one trial. ``spec_for(node_dir)`` gives a node's launcher spec,
    ``env`` the environment they share (storage, settings, the planted credential)."""

    workdir: Path
    marker: str
    env: dict[str, str]
    spec_for: Callable[[Path, int], LaunchSpec]  # a node's directory, the store's port
    # Where the nodes' stand-ins for /dev/shm go (a benchmark puts them on a tmpfs, and
    # close() removes them); None: in ``workdir``, left for the checks.
    shm_base: Path | None = None
    nodes: list[Node] = field(default_factory=list)
    store: RendezvousStore | None = None

    def start(self, count: int, degraded: int | None = None) -> None:
        """The rendezvous store and ``count`` nodes; node ``degraded`` (if any) on a
        shared-memory root elastictrain refuses."""
        self.store = RendezvousStore(self.workdir, self.marker, self.env)
        for index in range(count):
            self.add(index, degraded=index == degraded)

    def add(self, index: int, *, degraded: bool = False) -> Node:
        """Start the next incarnation of node ``index`` (the first, or a replacement),
        with an empty stand-in for ``/dev/shm`` (mode 1777, like the real one);
        ``degraded``: with this user's root in it made open to others (0755), which
        its launcher refuses for its rescue marks (it goes on without them), and its
        memory directory named apart (``snapshot.memory_dir``, private) so that the
        memory tier, which refuses such a root outright, still runs there."""
        assert self.store is not None
        incarnation = sum(1 for n in self.nodes if n.index == index)
        node_dir = self.workdir / f"node{index}.{incarnation}"
        shm = (self.shm_base or self.workdir) / f"shm{index}"
        shm.mkdir(parents=True, exist_ok=True)
        shm.chmod(0o1777)
        if degraded:
            refused = user_root_in(shm)
            refused.mkdir(exist_ok=True)
            refused.chmod(0o755)
        root = user_root_in(shm)
        degraded = root.is_dir() and bool(root.stat().st_mode & 0o077)
        env = {**self.env, SHM_VAR: str(shm)}
        if degraded:  # inside the stand-in: wiped with the node's memory
            env["ELASTICTRAIN_SNAPSHOT__MEMORY_DIR"] = str(shm / "memory")
        job = Job(self.spec_for(node_dir, self.store.port), env,
                  node_dir, f"{self.marker}/node{index}.{incarnation}")
        node_dir.mkdir(parents=True, exist_ok=True)
        node = Node(index, incarnation, job, shm, started_ts=time.time())
        job.launch()
        self.nodes.append(node)
        return node

    def current(self, index: int) -> Node:
        return [n for n in self.nodes if n.index == index][-1]

    def freeze(self, node: Node) -> list[int]:
        """SIGSTOP every process of ``node`` until a scan finds none it has not stopped;
        returns the PIDs. :meth:`wipe` empties its memory."""
        node.lost_ts = time.time()
        stopped: set[int] = set()
        while True:
            found = set(processes_with_marker(node.job.marker)) - stopped
            if not found:
                break
            for pid in found:
                signal_pid(pid, signal.SIGSTOP)
            stopped |= found
        # SIGSTOP takes effect once each thread leaves the system call it is in (a
        # rename, a write into the memory directory): wipe only after every thread has
        # stopped, or a write in flight lands in the wiped directory.
        deadline = time.monotonic() + STOP_WAIT_S
        while not all(halted(pid) for pid in stopped) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return sorted(stopped)

    def wipe(self, node: Node) -> None:
        """Empty a frozen ``node``'s memory directory (a lost machine's RAM is gone)."""
        wipe(node.shm)

    def kill(self, node: Node) -> list[int]:
        """SIGKILL every process of a frozen ``node`` and reap its launcher."""
        pids = processes_with_marker(node.job.marker)
        for pid in pids:
            signal_pid(pid, signal.SIGKILL)
        node.job.close()  # waits for the launcher, closes its log, waits for the rest
        return sorted(pids)

    def running(self) -> list[Node]:
        return [n for n in self.nodes if n.running]

    def close(self) -> None:
        for node in self.nodes:
            node.job.close()
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.shm_base is not None:
            shutil.rmtree(self.shm_base, ignore_errors=True)


def halted(pid: int) -> bool:
    """Every thread of ``pid`` is stopped (or the process is gone)."""
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
        return all(stat_fields(f"{pid}/task/{task.name}")[0] in _HALTED for task in tasks)
    except (OSError, IndexError):  # gone
        return True


def wipe(shm: Path) -> None:
    """Empty a node's stand-in for ``/dev/shm`` (its memory directories, rescue marks)."""
    for entry in shm.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
