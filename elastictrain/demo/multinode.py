"""Several torchrun agents ("nodes") on one machine: a node failure and a replacement.

``elastictrain demo --nnodes 1:2 --kill-node-at K --add-node-at A`` starts MAX
agents with ``--nnodes MIN:MAX`` and c10d rendezvous on ``127.0.0.1:<free
port>``. The first agent hosts the rendezvous store (``is_host=1``), the others
connect to it (``is_host=0``). Killing the host would end the job for everyone
(the store lives in that process), so the node that fails is the last one started.

Node failure at step K: the victim's workers stop after step K at full size and
each writes a marker with its PID (so the failure happens at a known step); the
runner then SIGKILLs the victim agent's process group and each of its workers by
PID (torchrun starts workers in their own session, so killing the agent's group
alone would leave them running). The survivors' collectives fail, their agent
restarts them (one restart), the rendezvous drops the dead node once its
keep-alives stop, and the job resumes from the newest snapshot one node smaller.

Replacement at step A: the survivors stop after step A at the smaller size (and
after that restart) and write markers; the runner starts a new agent. The running
agents see a node waiting, restart their workers (not counted as a restart) and
the job resumes from the newest snapshot at full size. Without ``--kill-node-at``
the job starts one node short and ``--add-node-at`` grows it.

Start: the agents start together, but one may miss the first round's last call
(1 s); the job then forms one node short. Its workers wait before training until
their agent restarts them for the late node, so the run does not race ahead.

Workers that wait for the runner give up after ``PARK_TIMEOUT_S`` and train on.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from elastictrain.core.env import LAUNCH_ID_VAR
from elastictrain.core.errors import ConfigError, ElasticTrainError
from elastictrain.core.log import get_logger
from elastictrain.demo.job import RunningJob
from elastictrain.handoff.rescue_marks import launcher_marks_dir, save_requested
from elastictrain.launcher.spawn import DEFAULT_RDZV_CONF, LaunchSpec, start_torchrun
from elastictrain.runlog.events import new_launch_id
from elastictrain.runlog.events_read import read_events
from elastictrain.runlog.launches import node_launch_id
from elastictrain.worker import preempt

log = get_logger("elastictrain.demo")

PARK_TIMEOUT_S = 300.0
_PARK_POLL = threading.Event()  # never set: an interruptible sleep
GATE_TIMEOUT_S = 600.0  # the runner's wait for a gate: a whole small demo fits in it
STOP_GRACE_S = 30.0


def parse_nnodes(spec: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` as (min, max); ConfigError naming the value otherwise."""
    parts = spec.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise ConfigError(f"--nnodes={spec}: expected N or MIN:MAX with 1 <= MIN <= MAX "
                          "(e.g. 1:2)")
    return lo, hi


def free_port() -> int:
    """A TCP port nobody listens on right now (bind to 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- worker side ------------------------------------------------------------------------
@dataclass(frozen=True)
class Park:
    """Stop when the world has ``world_size`` ranks and this agent has restarted
    ``min_restarts``..``max_restarts`` times, after ``step`` (None: before the first
    step of the attempt); write a marker and wait for the runner to act."""

    name: str
    step: int | None
    world_size: int
    min_restarts: int
    max_restarts: int | None

    def to_arg(self) -> str:
        step = "start" if self.step is None else self.step
        top = -1 if self.max_restarts is None else self.max_restarts
        return f"--park={self.name}:{step}:{self.world_size}:{self.min_restarts}:{top}"

    @classmethod
    def parse(cls, spec: str) -> Park:
        name, step, world, low, top = spec.split(":")
        return cls(name, None if step == "start" else int(step), int(world), int(low),
                   None if int(top) < 0 else int(top))

    def applies(self, step: int | None, world_size: int, restart_count: int) -> bool:
        top = restart_count if self.max_restarts is None else self.max_restarts
        return ((step, world_size) == (self.step, self.world_size)
                and self.min_restarts <= restart_count <= top)


def wait_at_gates(parks: list[Park], directory: Path, step: int | None, world_size: int,
                  restart_count: int, rank: int, timeout_s: float = PARK_TIMEOUT_S) -> None:
    """If a gate applies here, write its marker and wait (the runner kills this worker,
    or its agent restarts it, meanwhile); after ``timeout_s``, or at once when a
    preemption notice arrives (Ctrl-C on the demo) or the agent asks for a save before
    it restarts the group (a node joined), train on: the next step takes that snapshot,
    as a worker that never parked would."""
    marks = launcher_marks_dir()
    for park in parks:
        if not park.applies(step, world_size, restart_count):
            continue
        gate = directory / park.name
        gate.mkdir(parents=True, exist_ok=True)
        marker = {"pid": os.getpid(), "rank": rank, "step": step, "world_size": world_size}
        tmp = gate / f".rank{rank}-pid{os.getpid()}.tmp"
        tmp.write_text(json.dumps(marker))
        tmp.rename(gate / f"rank{rank}-pid{os.getpid()}.json")  # whole or absent
        log.warning("demo.parked", gate=park.name, pid=os.getpid())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            watcher = preempt.current()
            if watcher is not None and watcher.notice is not None:
                log.warning("demo.park_notice", gate=park.name)
                return
            if marks is not None and save_requested(marks):
                log.info("demo.park_restart", gate=park.name)
                return
            _PARK_POLL.wait(0.1)  # the notice arrives in a signal handler: poll it
        log.warning("demo.park_timeout", gate=park.name, timeout_s=timeout_s)


# -- runner side ------------------------------------------------------------------------
@dataclass
class Node:
    """One agent the runner started: its process (own session) and where it logs."""

    index: int
    proc: subprocess.Popen[bytes]
    events_dir: Path
    log_file: IO[str]
    killed: bool = False


@dataclass
class NodesPlan:
    """What the runner does: agents, workers per agent, when to kill and add a node."""

    nnodes: str
    nproc: int
    kill_node_at: int | None
    add_node_at: int | None
    worker_args: list[str]
    run_id: str
    events_dir: Path
    launch: str | None = None  # node i's launcher logs as launch "<launch>-n<i>"
    max_restarts: int = 3
    membership: list[dict[str, Any]] = field(default_factory=list)

    @property
    def bounds(self) -> tuple[int, int]:
        return parse_nnodes(self.nnodes)

    def world_sizes(self) -> tuple[int, int]:
        """(full, one node short) world sizes."""
        hi = self.bounds[1]
        return hi * self.nproc, (hi - 1) * self.nproc


def run_nodes(plan: NodesPlan, job: RunningJob) -> int:
    """Run the job on several agents; returns the exit code of the surviving agents
    (0 when all finished). Records membership changes in ``plan.membership``.

    SIGINT/SIGTERM to the demo meanwhile go to ``job`` (a notice to every agent; a
    second one kills): the runner then kills and adds no node and waits for the agents.
    """
    hi = plan.bounds[1]
    port = free_port()
    gates = plan.events_dir / "gates"
    nodes: list[Node] = []

    def start(index: int, park: list[str]) -> None:
        nodes.append(_start(plan, index, port, park))
        job.launchers.append(nodes[-1].proc)
        if job.interrupted is not None:  # the signal came while this node started
            _signal_group(nodes[-1].proc.pid, signal.SIGTERM)

    try:
        with job.signals_routed():
            first = hi if plan.kill_node_at is not None or plan.add_node_at is None else hi - 1
            for i in range(first):
                if job.interrupted is None:
                    start(i, _park_args(plan, i, first, gates))
            if plan.kill_node_at is not None:
                markers = _wait_markers(gates / "kill", plan.nproc, nodes, job)
                if markers is not None:
                    _kill_node(nodes[-1], [m["pid"] for m in markers])
                    plan.membership.append({"change": "node_killed", "node": nodes[-1].index,
                                            "after_step": plan.kill_node_at, "ts": time.time()})
            if plan.add_node_at is not None and _wait_markers(gates / "add", 1, nodes, job):
                start(len(nodes), [])
                plan.membership.append({"change": "node_added", "node": nodes[-1].index,
                                        "after_step": plan.add_node_at, "ts": time.time()})
            codes = [n.proc.wait() for n in nodes if not n.killed]
        job.reap()
        return next((c for c in codes if c != 0), 0)
    finally:
        for node in nodes:
            _stop(node)


def membership_timings(changes: list[dict[str, Any]],
                       events_dir: str | Path) -> list[dict[str, Any]]:
    """Each membership change with the world size and the seconds until the first
    training step after it (``demo.first_step`` of the next world's rank 0)."""
    firsts = sorted((e for p in Path(events_dir).rglob("attempt*-rank0.jsonl")
                     for e in read_events(p) if e.get("event") == "demo.first_step"),
                    key=lambda e: e["ts"])
    out = []
    for change in changes:
        after = next((e for e in firsts if e["ts"] > change["ts"]), None)
        out.append({
            "change": change["change"], "node": change["node"],
            "after_step": change["after_step"],
            "world_size": after["world_size"] if after else None,
            "seconds_to_first_step": round(after["ts"] - change["ts"], 2) if after else None,
        })
    return out


def _park_args(plan: NodesPlan, index: int, started: int, gates: Path) -> list[str]:
    full, short = plan.world_sizes()
    lo, hi = plan.bounds
    parks = []
    if started == hi:
        # A slow agent can miss the first round's last call; a first attempt that is
        # short of nodes then waits for it (its agent restarts it when the node
        # arrives) instead of training ahead.
        parks += [Park("start", None, n * plan.nproc, 0, 0) for n in range(lo, hi)]
    if plan.kill_node_at is not None and index == started - 1:
        parks.append(Park("kill", plan.kill_node_at, full, 0, None))
    elif plan.add_node_at is not None:
        # The survivors' agents restarted once after a kill; without a kill the job
        # started one node short and nobody has.
        low = 1 if plan.kill_node_at is not None else 0
        parks.append(Park("add", plan.add_node_at, short, low, None))
    return [f"--park-dir={gates}", *(p.to_arg() for p in parks)] if parks else []


def _start(plan: NodesPlan, index: int, port: int, extra_args: list[str]) -> Node:
    events = plan.events_dir / f"node{index}"
    events.mkdir(parents=True, exist_ok=True)
    is_host = 1 if index == 0 else 0
    # Named per launch: a relaunch on the same storage keeps the earlier launches' logs.
    launch = node_launch_id(plan.launch or new_launch_id(), index)
    spec = LaunchSpec(nproc_per_node=plan.nproc, module="elastictrain.demo.worker",
                      script_args=[*plan.worker_args, f"--events-dir={events}", *extra_args],
                      nnodes=plan.nnodes, max_restarts=plan.max_restarts,
                      rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=plan.run_id,
                      rdzv_conf=f"{DEFAULT_RDZV_CONF},is_host={is_host}",
                      log_dir=str(events / "torchelastic" / launch))
    log_file = open(events / f"launcher-{launch}.log", "w")  # noqa: SIM115 - closed in _stop
    proc = start_torchrun(spec, stdout=log_file, extra_env={LAUNCH_ID_VAR: launch})
    (events / "agent.pid").write_text(str(proc.pid))  # for operators and test cleanup
    return Node(index, proc, events, log_file)


def _wait_markers(directory: Path, count: int, nodes: list[Node],
                  job: RunningJob) -> list[dict[str, Any]] | None:
    """Poll for ``count`` park markers; None once the demo was interrupted (nothing
    more to orchestrate); fail if every agent exited or time runs out."""
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while time.monotonic() < deadline:
        if job.interrupted is not None:
            return None
        found = sorted(directory.glob("rank*.json")) if directory.exists() else []
        if len(found) >= count:
            return [json.loads(p.read_text()) for p in found]
        if all(n.proc.poll() is not None for n in nodes if not n.killed):
            raise ElasticTrainError(f"every agent exited before the workers reached the "
                                    f"{directory.name} gate; see {directory.parent.parent}")
        time.sleep(0.05)
    raise ElasticTrainError(f"the workers did not reach the {directory.name} gate within "
                            f"{GATE_TIMEOUT_S:.0f}s; see {directory.parent.parent}")


def _kill_node(node: Node, worker_pids: list[int]) -> None:
    """A node failure: SIGKILL the agent's process group, then each worker by PID."""
    node.killed = True
    _signal_group(node.proc.pid, signal.SIGKILL)
    for pid in worker_pids:
        with contextlib.suppress(ProcessLookupError):  # already gone with its agent
            os.kill(pid, signal.SIGKILL)
    node.proc.wait()


def _stop(node: Node) -> None:
    """Stop an agent that is still running: SIGTERM (it stops its workers), then SIGKILL."""
    if node.proc.poll() is None:
        _signal_group(node.proc.pid, signal.SIGTERM)
        try:
            node.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(node.proc.pid, signal.SIGKILL)
            node.proc.wait()
    node.log_file.close()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
