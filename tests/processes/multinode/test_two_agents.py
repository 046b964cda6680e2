"""The user's scripts under two agents on this machine, from start to a clean end.

Each "node" is its own launcher (``elastictrain run`` or plain ``torchrun``) with one
worker, joined by a c10d rendezvous on 127.0.0.1, as docs/guide.md describes multi-node
use: the README's example and the FSDP2 example, unmodified. Both launchers must exit 0
soon after the last step, and no attempt may re-run the end (resume from the final
step). Then the faults at the end: a worker failing after the agreed end, a SIGTERM while
an agent waits for the other node, and a node lost and replaced mid-run; and a node that
joins mid-run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from elastictrain.launcher.spawn import DEFAULT_RDZV_CONF
from tests.helpers import REPO, child_env, descendants, events, free_port, kill_tree, run_cli

pytestmark = pytest.mark.distributed

TRAIN_JOB = REPO / "tests" / "train_job.py"
EXAMPLES = {"ddp": (REPO / "examples" / "ddp_resumable.py", []),
            "fsdp": (REPO / "examples" / "fsdp_resumable.py", ["--steps", "40"])}


@dataclass
class Node:
    proc: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


class Cluster:
    """Agents of one job on this machine; every process they started is stopped."""

    def __init__(self, tmp_path: Path, launcher: str, nnodes: str, script: str) -> None:
        self.tmp_path, self.launcher, self.nnodes = tmp_path, launcher, nnodes
        self.script, self.script_args = EXAMPLES[script]
        self.port = free_port()
        self.storage = tmp_path / "storage"
        self.nodes: list[Node] = []
        self.started = 0
        self.rdzv_id = f"two-{self.port}"

    def command(self, extra: list[str]) -> list[str]:
        head = ([sys.executable, "-m", "elastictrain.cli", "run", "--no-view"]
                if self.launcher == "run" else [sys.executable, "-m", "torch.distributed.run"])
        return [*head, "--nproc-per-node", "1", "--max-restarts", "3", "--nnodes", self.nnodes,
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
                "--rdzv-id", self.rdzv_id, *extra, str(self.script), str(self.storage),
                *self.script_args]

    def start(self, extra: list[str] | None = None, env: dict[str, str] | None = None) -> Node:
        # Numbered by start, not by place in ``nodes``: a lost node is removed from it.
        self.started += 1
        log = self.tmp_path / f"node{self.started - 1}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                self.command(extra or []), stdout=out, stderr=subprocess.STDOUT,
                cwd=self.tmp_path, start_new_session=True,
                env=child_env(self.tmp_path, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                              **(env or {})))
        node = Node(proc, log)
        self.nodes.append(node)
        if len(self.nodes) == 1:  # the rendezvous host listens before the others join
            wait_until(lambda: port_open(self.port) or proc.poll() is not None, 120,
                       f"the first agent's rendezvous port (log: {node.text()[-2000:]})")
        return node

    def wait_all(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for node in self.nodes:
            try:
                codes.append(node.proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                logs = "\n".join(n.text()[-3000:] for n in self.nodes)
                raise AssertionError(f"an agent did not end in {timeout} s:\n{logs}") from None
        return codes

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                kill_tree(node.proc.pid)
            with suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=30)


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Any]:
    made: list[Cluster] = []

    def make(launcher: str, nnodes: str, script: str = "ddp") -> Cluster:
        made.append(Cluster(tmp_path, launcher, nnodes, script))
        return made[-1]

    try:
        yield make
    finally:
        for job in made:
            job.stop()


def job_events(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    """This job's events: the workers' beside the snapshots, the agents' (which cannot
    know the script's storage) under the default run directory."""
    found: dict[str, dict[str, Any]] = {}
    for root in (cluster.storage / "events", cluster.tmp_path / "elastictrain-run"):
        if root.exists():  # a worker's file may show in both (a link): each event once
            found.update((json.dumps(e, sort_keys=True), e) for e in events(root, name))
    return list(found.values())


def worker_events(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return [e for e in job_events(cluster, name) if e.get("role") != "agent"]


def assert_clean_end(cluster: Cluster) -> None:
    finished = worker_events(cluster, "run.finished")
    assert len(finished) == 1, f"the run's end recorded {len(finished)} times"
    end, ended_at = finished[0]["final_step"], finished[0]["ts"]
    again = [e for e in worker_events(cluster, "resume") if e["ts"] > ended_at]
    assert not again, f"an attempt started after the end: {again}"
    assert not job_events(cluster, "agent.grace_expired")
    # What an operator reads, from the storage the script was given.
    status = run_cli(["status", str(cluster.storage), "--json"], cluster.tmp_path)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["finished"] == "finished"
    report = run_cli(["goodput", str(cluster.storage), "--json"], cluster.tmp_path)
    assert report.returncode == 0, report.stderr
    goodput = json.loads(report.stdout)
    assert goodput["final_step"] == end
    assert goodput["split"]["attempts"][-1]["ended_by"] == "finished"


# The suite runs each example under each launcher and each launcher with each --nnodes
# (the README's example under elastictrain run at 2:2: test_a_node_lost_and_replaced_mid_run,
# which ends with the same checks); ET_TEST_ALL_COMBINATIONS=1 runs all eight (by hand).
COMBINATIONS = ([(launcher, nnodes, script) for launcher in ("run", "torchrun")
                 for nnodes in ("2:2", "1:2") for script in ("ddp", "fsdp")]
                if os.environ.get("ET_TEST_ALL_COMBINATIONS") == "1" else
                [("torchrun", "1:2", "ddp"), ("run", "1:2", "fsdp"), ("torchrun", "2:2", "fsdp")])


@pytest.mark.parametrize("launcher,nnodes,script", COMBINATIONS)
def test_both_agents_end_cleanly(cluster: Any, launcher: str, nnodes: str, script: str) -> None:
    job = cluster(launcher, nnodes, script)
    # Both nodes must be in the run for its end to be theirs. With "1:2" and the launcher's
    # one-second last call, the first node trains alone at once and, on a loaded machine,
    # can finish all 40 steps before the second has imported torch; the second then runs
    # its own one-node attempt from the final step. A last call as long as torchrun's
    # default lets the second join the first round (the rendezvous closes when it does).
    # A node joining a run in progress: test_a_node_joining_mid_run_costs_no_step.
    long_last_call = DEFAULT_RDZV_CONF.replace("last_call_timeout=1,", "last_call_timeout=30,")
    assert long_last_call != DEFAULT_RDZV_CONF
    extra = ([f"--rdzv-conf={long_last_call}"] if launcher == "run" and nnodes == "1:2"
             else [])
    job.start(extra)
    job.start(extra)
    assert job.wait_all(timeout=240) == [0, 0]
    assert_clean_end(job)
    if launcher == "run":
        restarts = [e for e in job_events(job, "agent.restart")
                    if e.get("reason") == "failure"]
        assert not restarts, f"a clean run restarted after a failure: {restarts}"


# A short run, then what ranks do after close(): "fail" (rank 1 dies after the agreed
# end, as a worker aborting in teardown would; rank 0 still writes FLAG) or "late" (rank 1
# writes FLAG and evaluates for an hour while rank 0's node waits for it; "late-here": the
# same on the node started with ET_TEST_LATE=1, which writes its pid). Or before it:
# "late-gate": as "late-here", until the test writes FLAG.go. Or before it:
# "vanish" (rank 1 writes its pid to FLAG after its last step and waits there, once, for
# the test to take its node away before the end is agreed).
AFTER_THE_END = '''
import os, sys, time, torch
import elastictrain as et
storage, mode, flag = sys.argv[1:4]
rt = et.init()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
snap = et.SnapshotManager(storage, model=model, optimizer=opt, ctx=rt.ctx, every_steps=5)
snap.restore()
while snap.step_count < 10:
    model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad(); snap.step()
if mode == "vanish" and rt.rank == 1 and not os.path.exists(flag):
    open(flag + ".tmp", "w").write(str(os.getpid()))
    os.rename(flag + ".tmp", flag)
    time.sleep(3600)
snap.close()
if mode == "fail" and rt.rank == 1:
    os._exit(3)
if mode == "fail" and rt.rank == 0:
    open(flag, "w").write("evaluated")
et.shutdown()
if mode == "late" and rt.rank == 1:
    open(flag, "w").write("evaluating")
    time.sleep(3600)
if mode == "late-here" and os.environ.get("ET_TEST_LATE") == "1":
    open(flag + ".tmp", "w").write(str(os.getpid()))
    os.rename(flag + ".tmp", flag)
    time.sleep(3600)
if mode == "late-gate" and os.environ.get("ET_TEST_LATE") == "1":
    open(flag + ".tmp", "w").write(str(os.getpid()))
    os.rename(flag + ".tmp", flag)
    while not os.path.exists(flag + ".go"):  # the test opens the gate
        time.sleep(0.02)
'''


def after_the_end(cluster: Any, tmp_path: Path, mode: str, launcher: str = "run",
                  nnodes: str = "2:2") -> tuple[Cluster, Path]:
    script, flag = tmp_path / "after_the_end.py", tmp_path / "flag"
    script.write_text(AFTER_THE_END)
    job = cluster(launcher, nnodes)
    job.script, job.script_args = script, [mode, str(flag)]
    return job, flag


def test_a_worker_failing_after_the_end_does_not_restart_the_run(
        cluster: Any, tmp_path: Path) -> None:
    job, flag = after_the_end(cluster, tmp_path, "fail")
    job.start()
    job.start()
    assert job.wait_all(timeout=180) == [0, 0]
    after = job_events(job, "agent.failed_after_end")
    assert len(after) == 1 and list(after[0]["exit_codes"].values()) == [3]
    assert not job_events(job, "agent.restart")
    assert flag.read_text() == "evaluated"  # rank 0's work after close() was not cut


def test_sigterm_ends_an_agent_waiting_for_another_node(cluster: Any, tmp_path: Path) -> None:
    """Node A finished and waits in torchrun's exit barrier (a C++ store call, where its
    Python signal handler may not run) for node B, still busy: a scheduler's SIGTERM ends
    A within --shutdown-timeout + 10 s, with exit 0 (its run finished) and nothing left
    (the grace watch itself: tests/processes/launcher/test_gracewatch.py)."""
    job, flag = after_the_end(cluster, tmp_path, "late")
    first = job.start(["--shutdown-timeout", "5"])
    job.start()
    wait_until(flag.exists, 180, "rank 1's evaluation after the end")
    workers = [int(pid) for line in first.text().splitlines() if "agent.attempt_started" in line
               for pid in json.loads(line[line.index("{"):])["pids"].values()]
    wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 120,
               "node A's worker to end")
    tree = descendants(first.proc.pid)
    started = time.monotonic()
    first.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait(timeout=60) == 0
    assert time.monotonic() - started < 5 + 10 + 5
    # SIGKILLed members (the standby) take a moment to go; a zombie left to PID 1 runs nothing.
    wait_until(lambda: not any(running(pid) for pid in tree), 10, "node A's processes to end")


def test_a_node_lost_and_replaced_mid_run(cluster: Any) -> None:
    """Node B's whole tree is SIGKILLed after the snapshot of step 10 committed; a new
    agent takes its place; the job resumes at world size 2, ends cleanly, every agent 0."""
    job = cluster("run", "2:2")
    job.start()
    lost = job.start()
    committed = job.storage / "snapshots" / "step_000000000010" / "MANIFEST.json"
    wait_until(committed.exists, 180, "the snapshot of step 10")
    resumed = replace_node(job, lost)
    assert resumed and all(e["from_step"] >= 10 for e in resumed)


def test_a_node_joining_mid_run_costs_no_step(cluster: Any, tmp_path: Path) -> None:
    """A second node joins a one-node job (``--nnodes 1:2``) while it trains, with no
    periodic snapshot to go back to. Before torchrun restarts the healthy group at world
    size 2, the agent asks its worker for a snapshot of the step it is at: the new group
    resumes there, from the first node's memory (the joining node receives it from that
    node), instead of starting over."""
    gates = tmp_path / "gates"
    job = cluster("run", "1:2")
    job.script = TRAIN_JOB
    job.script_args = ["400", "--every", "1000", "--memory-every", "1000", "--step-s", "0.05",
                       "--park", "5", "--gates", str(gates)]
    env = {"PYTHONPATH": str(REPO)}  # the job imports the tests' helpers
    job.start(env=env)
    wait_until((gates / "rank0.json").exists, 180, "the lone node to train 5 steps")
    job.start(env=env)
    (gates / "go").write_text("")  # trains on while the second node starts and joins
    assert job.wait_all(timeout=240) == [0, 0]
    assert_clean_end(job)
    (saved,) = worker_events(job, "snapshot.saved_for_restart")
    assert saved["tier"] == "memory" and 5 < saved["snapshot_step"] < 400
    (waited,) = job_events(job, "agent.saved_before_restart")
    assert (waited["ready"], waited["listening"], waited["timed_out"]) == (1, 1, False)
    resumed = [e for e in worker_events(job, "resume") if e.get("world_size") == 2]
    assert sorted((e["from_step"], e["tier"]) for e in resumed) == [
        (saved["snapshot_step"], "memory")] * 2


def replace_node(job: Cluster, lost: Node) -> list[dict[str, Any]]:
    """SIGKILL ``lost``'s whole tree, start a new agent in its place, and check that the
    job ends cleanly at world size 2; returns the workers' resumes from a snapshot."""
    kill_tree(lost.proc.pid)
    lost.proc.wait(timeout=30)
    job.nodes.remove(lost)
    job.start()
    assert job.wait_all(timeout=240) == [0, 0]
    assert_clean_end(job)
    resumed = [e for e in worker_events(job, "resume") if e.get("from_step")]
    assert {e["world_size"] for e in resumed} == {2}
    return resumed


@pytest.mark.parametrize("launcher", ["run", "torchrun"])
def test_a_node_lost_after_its_last_step_and_replaced_ends_the_run(
        cluster: Any, tmp_path: Path, launcher: str) -> None:
    """Node B is lost after its last step and before the end agreement in close(): the
    survivor's close() raises (no agreed end) instead of exiting 0 into torchrun's exit
    barrier, its launcher restarts it, and with B's replacement the job resumes at the
    end and finishes, every agent 0."""
    job, flag = after_the_end(cluster, tmp_path, "vanish", launcher)
    job.start()
    job.start()
    wait_until(flag.exists, 180, "rank 1 after its last step")
    vanishing = int(flag.read_text())
    lost = next(n for n in job.nodes if vanishing in descendants(n.proc.pid))
    replace_node(job, lost)
    assert worker_events(job, "run.end_not_agreed"), "the survivor saw no failed end"


def test_a_node_lost_after_the_agreed_end_holds_no_survivor(
        cluster: Any, tmp_path: Path) -> None:
    """Node B agreed the run's end and is lost while its script works on after close()
    (node A, the rendezvous host, is already in the exit barrier): A's agent stops
    waiting for B once B's keep-alive expires and exits 0 within seconds, not after
    torchrun's 300 s barrier; a replacement started for B exits 0 (the job it came to
    join finished), and nothing runs the finished job again."""
    job, flag = after_the_end(cluster, tmp_path, "late-here")
    # B's keep-alive expires 20 s after its loss (not the default 6 s), so that the
    # replacement, which takes seconds to start on a busy machine, arrives while A is in
    # the barrier; one that arrives after A left finds no rendezvous (exit 1, its message
    # says the job may have finished).
    conf = DEFAULT_RDZV_CONF.replace("keep_alive_max_attempt=3", "keep_alive_max_attempt=10")
    assert conf != DEFAULT_RDZV_CONF
    extra = [f"--rdzv-conf={conf}"]
    first = job.start(extra)
    lost = job.start(extra, env={"ET_TEST_LATE": "1"})
    wait_until(flag.exists, 180, "node B's script after the end")
    assert int(flag.read_text()) in descendants(lost.proc.pid)
    kill_tree(lost.proc.pid)
    lost.proc.wait(timeout=30)
    job.nodes.remove(lost)
    lost_at = time.monotonic()
    replacement = job.start(extra)
    assert first.proc.wait(timeout=120) == 0, first.text()[-3000:]
    # B's keep-alive expires after 20 s; the barrier reads the rendezvous every second.
    assert time.monotonic() - lost_at < 60
    short = job_events(job, "agent.exit_barrier_short")
    assert [(e["arrived"], e["live"], e["group_world_size"]) for e in short] == [(1, 1, 2)]
    # A stayed while the replacement waited in the rendezvous: it read the closed round
    # and the finished job, and has nothing to do.
    assert replacement.proc.wait(timeout=120) == 0, replacement.text()[-3000:]
    assert len(job_events(job, "agent.job_already_finished")) == 1
    assert_clean_end(job)


@pytest.mark.parametrize("event", ["host_lost", "node_joins"])
def test_a_script_working_after_the_end_is_left_to_finish(
        cluster: Any, tmp_path: Path, event: str) -> None:
    """Node B's script works on after close() (an evaluation, an export) while node A,
    which serves the rendezvous store, waits in the exit barrier. Then A is lost
    ("host_lost"), or a third node arrives to join a job of 2 to 3 nodes ("node_joins",
    which torchrun would take in with a restart). B's agent neither
    fails on the lost store nor restarts the finished group for the newcomer: B's script
    ends when it is done, every launcher left exits 0 (the newcomer reads that the job
    finished), and the run's end is recorded once."""
    job, flag = after_the_end(cluster, tmp_path, "late-gate",
                              nnodes="2:2" if event == "host_lost" else "2:3")
    host = job.start()
    late = job.start(env={"ET_TEST_LATE": "1"})
    wait_until(flag.exists, 180, "node B's script after the end")
    assert int(flag.read_text()) in descendants(late.proc.pid)
    if event == "host_lost":
        kill_tree(host.proc.pid)
        host.proc.wait(timeout=30)
        job.nodes.remove(host)
        seen = "agent.rendezvous_lost_after_end"
    else:
        newcomer = job.start()
        seen = "agent.join_after_end_ignored"
    # What B's agent does about it: the event, or (as torchrun's own agent) a restart of
    # the group for the newcomer, or an exit on the lost store that ends B's script.
    wait_until(lambda: job_events(job, seen) or job_events(job, "agent.restart")
               or late.proc.poll() is not None, 120, f"{seen} (log: {late.text()[-2000:]})")
    assert late.proc.poll() is None, f"B's launcher ended: {late.text()[-3000:]}"
    assert not job_events(job, "agent.restart"), "the finished group was restarted"
    (tmp_path / "flag.go").write_text("")
    assert job.wait_all(timeout=120) == [0] * len(job.nodes), late.text()[-3000:]
    if event == "node_joins":
        assert newcomer.proc.returncode == 0
        assert len(job_events(job, "agent.job_already_finished")) == 1
    assert_clean_end(job)
