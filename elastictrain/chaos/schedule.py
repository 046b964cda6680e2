"""Seeded fault schedules: what a chaos trial injects, and when.

A trial's seed is derived from the run's ``--seed`` and the trial's index, so
``elastictrain chaos --seed S --first K --trials 1`` replays trial K alone.
Times are seconds after the trial's first launch; they are drawn over the clean
run's wall time, so faults land in every phase (startup, restore, training,
persist) and later ones often hit a restarted attempt.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass
from dataclasses import replace as replace_fields
from typing import Any

from elastictrain.core.errors import ConfigError

# Faults on processes; "storage" switches the fault-injecting store on for the trial.
PROCESS_FAULTS = ("kill", "relaunch", "notice", "stop")
FAULT_KINDS = (*PROCESS_FAULTS, "storage")
# Faults on the node-memory tier (docs/memory-tier.md), named with --faults only: a
# trial with one runs with the memory tier on, in a node tmpfs of its own.
# ``shm_neighbour``: a second run (another storage, the same default memory root) on
# the node; ``shm_full``: the memory tier's tmpfs (a small one, needs root) filled by a
# filler file; ``memory_corrupt``: a committed memory snapshot's payload corrupted.
MEMORY_FAULTS = ("shm_neighbour", "shm_full", "memory_corrupt")
# The standby's faults (runner.inject_standby_fault), asked for by name only, never
# drawn by default: a seed's default draws, and so its replay, do not depend on them.
STANDBY_FAULTS = ("standby_stop", "standby_kill", "pid_recycle")
# A whole node lost (chaos/nodes.py): one agent's process tree SIGKILLed and its memory
# directory wiped, in a job of several agents. Named with --faults only, with no other
# kind but ``storage``: a node trial runs a job of its own shape (agents, memory tier).
# ``join`` (with ``node`` only): a lost node that is not replaced at once comes back
# later, so the job that went on one node smaller grows back while it trains.
# ``stale`` (with ``node`` only): on half the trials the lost node's memory outlives its
# processes (an agent that died on a machine that did not), and the node comes back
# (replaced, or rejoining) on it: with snapshots of an attempt the job went on without.
# ``degraded`` (with ``node`` only): on half the trials one node (drawn, the lost one or
# another) starts with its shared-memory root open to others, which its launcher refuses
# for its rescue marks: that node runs without them, beside healthy ones.
# ``second`` (with ``node`` only): once the lost node is back (replaced, or rejoining)
# and the job has trained 1-5 more steps (drawn), a node is lost again, abruptly (the
# one that came back or another, drawn), and replaced: a loss after a replacement.
# ``pause`` (with ``node,join``): on half the trials where the lost node rejoins, the
# running nodes' workers are paused (SIGSTOP, 1-6 s, drawn) as it starts: the job is
# evaluating, or waiting for data, when the node joins; the join may cost no step.
NODE_FAULTS = ("node", "join", "stale", "degraded", "second", "pause")
ALL_KINDS = (*FAULT_KINDS, *MEMORY_FAULTS, *STANDBY_FAULTS, *NODE_FAULTS)


@dataclass(frozen=True)
class Fault:
    """One fault on a process.

    Attributes:
        kind: ``kill`` (SIGKILL a worker), ``relaunch`` (SIGKILL the launcher and its
            workers, then launch again), ``notice`` (SIGTERM: a preemption notice),
            ``stop`` (SIGSTOP a worker: the others' watchdogs fire).
        at_s: seconds after the trial's first launch.
        target: ``worker`` or ``launcher`` (notices go to either).
        rank: the worker's rank, modulo the world size.
    """

    kind: str
    at_s: float
    target: str
    rank: int

    def describe(self) -> str:
        who = f"rank{self.rank}" if self.target == "worker" else "launcher"
        return f"{self.kind}({who})@{self.at_s:.1f}s"


@dataclass(frozen=True)
class StorageFaults:
    """The fault-injecting store's settings for a trial (``[storage.faults]``)."""

    read_error_p: float
    write_error_p: float
    latency_s: float
    crash_after_bytes: int | None

    def describe(self) -> str:
        parts = [f"read_p={self.read_error_p:g}", f"write_p={self.write_error_p:g}",
                 f"latency={self.latency_s:g}s"]
        if self.crash_after_bytes is not None:
            parts.append(f"crash@{self.crash_after_bytes}B")
        return "storage(" + ",".join(parts) + ")"


@dataclass(frozen=True)
class MemoryFault:
    """One fault on the node-memory tier (``MEMORY_FAULTS``), ``at_s`` after the first
    launch."""

    kind: str
    at_s: float

    def describe(self) -> str:
        return f"{self.kind}@{self.at_s:.1f}s"


@dataclass(frozen=True)
class NodeFault:
    """One node lost: ``at_s`` seconds after the trained step ``at_step`` was first
    recorded (the demo's sample records), or after the agents started when
    ``at_step`` is None (a loss during start-up).

    Attributes:
        node: the agent's index (any of them: the rendezvous store runs apart).
        replace: a new agent with the same index and an empty memory directory starts
            ``replace_after_s`` after the loss; else the job goes on one node smaller.
        rejoin_after_steps: a job that went on one node smaller (not ``replace``)
            takes a new agent for the lost node once it has trained this many steps
            after the loss (a join while it trains: the job grows back); None: never.
        silent: the node's processes are frozen (SIGSTOP) for ``hold_s`` before the
            SIGKILL, so its peers meet silence as from a machine that vanished, not the
            connection resets that processes killed on a live kernel send.
        keep_memory: the node's memory directory outlives its processes, and the node
            comes back on it (``stale``); else it is wiped with them.
        degraded: the node (an index) that starts with a shared-memory root elastictrain
            refuses (``degraded``), or None.
        second: the node (an index) lost a second time, abruptly, once the lost node is
            back and the job trained ``second_after_steps`` more steps (``second``); it
            is replaced. None: no second loss.
        pause_s: the running nodes' workers are paused (SIGSTOP) this long from the
            moment the lost node rejoins (``pause``); 0: no pause.
    """

    at_step: int | None
    at_s: float
    node: int
    replace: bool
    replace_after_s: float
    silent: bool
    hold_s: float
    rejoin_after_steps: int | None = None
    keep_memory: bool = False
    degraded: int | None = None
    second: int | None = None
    second_after_steps: int = 0
    pause_s: float = 0.0

    def describe(self) -> str:
        how = f"silent {self.hold_s:g}s" if self.silent else "abrupt"
        paused = f" during a {self.pause_s:g}s pause" if self.pause_s else ""
        then = (f"replaced +{self.replace_after_s:g}s" if self.replace
                else f"not replaced, rejoins after {self.rejoin_after_steps} step(s){paused}"
                if self.rejoin_after_steps is not None else "not replaced")
        when = (f"start+{self.at_s:.1f}s" if self.at_step is None
                else f"step{self.at_step}+{self.at_s:.2f}s")
        kept = ", memory kept" if self.keep_memory else ""
        degraded = f", node{self.degraded} degraded" if self.degraded is not None else ""
        second = (f", then node{self.second} lost {self.second_after_steps} step(s) after "
                  "the comeback" if self.second is not None else "")
        return f"node(node{self.node}, {how}, {then}{kept}{degraded}{second})@{when}"


@dataclass(frozen=True)
class Schedule:
    """Everything one trial injects."""

    trial: int
    seed: int
    faults: tuple[Fault, ...]
    storage: StorageFaults | None
    memory: tuple[MemoryFault, ...] = ()
    node: NodeFault | None = None

    def describe(self) -> str:
        parts = [f.describe() for f in self.faults]
        if self.storage is not None:
            parts.append(self.storage.describe())
        parts += [f.describe() for f in self.memory]
        if self.node is not None:
            parts.append(self.node.describe())
        return " ".join(parts) or "none"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_kinds(text: str) -> tuple[str, ...]:
    """``kill,notice`` → ("kill", "notice"); one line naming a bad kind."""
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in ALL_KINDS]
    if unknown or not kinds:
        raise ConfigError(f"--faults={text!r}: unknown or empty fault kind {unknown}; fix: "
                          f"choose from {','.join(ALL_KINDS)}")
    others = [k for k in kinds if k not in (*NODE_FAULTS, "storage")]
    if "pause" in kinds and "join" not in kinds:
        raise ConfigError(f"--faults={text!r}: pause is a pause in training while a lost node "
                          "rejoins, so it needs join; fix: --faults node,join,pause")
    for kind in ("join", "stale", "degraded", "second", "pause"):
        if kind in kinds and "node" not in kinds:
            raise ConfigError(f"--faults={text!r}: {kind} is a lost node coming back, so it "
                              f"needs node; fix: --faults node,{kind}")
    if "node" in kinds and others:
        # A node trial is a job of several agents, judged by checks of its own; the
        # process and memory kinds target one agent's job.
        raise ConfigError(f"--faults={text!r}: node combines only with storage, not "
                          f"{','.join(others)}; fix: run the node faults on their own, e.g. "
                          "--faults node,storage")
    return kinds


def trial_seed(seed: int, trial: int) -> int:
    """A trial's seed: stable across runs, machines and Python versions."""
    return int(hashlib.sha256(f"{seed}:{trial}".encode()).hexdigest()[:12], 16)


def make_schedule(seed: int, trial: int, kinds: tuple[str, ...], horizon_s: float,
                  world_size: int, nodes: int = 1, *, replace: bool | None = None,
                  steps: int = 60, step_s: float = 0.1) -> Schedule:
    """The schedule of trial ``trial``: one or two process faults drawn from ``kinds``
    at times within ``horizon_s`` (the clean run's wall time), and storage faults on
    half the trials when ``storage`` is among the kinds (on all when it is the only one).
    Two stops in one trial stop the same rank: the claim under test is that a rank that
    hangs is found by its peers' watchdogs, which needs a peer that still runs.
    With ``node`` among the kinds, one node fault on one of ``nodes`` agents, replaced
    or not as ``replace`` says (None: drawn), at a drawn step of ``steps`` (plus up to
    ``step_s``, the clean run's time per step) or, on some trials, during start-up.
    """
    s = trial_seed(seed, trial)
    rng = random.Random(s)  # private: never the caller's random streams
    process_kinds = [k for k in kinds if k in PROCESS_FAULTS or k in STANDBY_FAULTS]
    faults: list[Fault] = []
    if process_kinds:
        for _ in range(rng.randint(1, 2)):
            kind = rng.choice(process_kinds)
            target = rng.choice(("worker", "launcher")) if kind == "notice" else (
                "launcher" if kind == "relaunch" else "worker")
            at_s = round(rng.uniform(0.1, 0.9) * horizon_s, 2)
            rank = rng.randrange(world_size)  # drawn in this order: seeds replay as before
            stopped = [f.rank for f in faults if f.kind == "stop"]
            if kind == "stop" and stopped:
                rank = stopped[0]
            faults.append(Fault(kind=kind, at_s=at_s, target=target, rank=rank))
    storage = None
    if "storage" in kinds and (not process_kinds or rng.random() < 0.5):
        storage = StorageFaults(
            read_error_p=rng.choice((0.0, 0.02, 0.05)),
            write_error_p=rng.choice((0.0, 0.05, 0.1)),
            latency_s=rng.choice((0.0, 0.01, 0.05)),
            crash_after_bytes=rng.choice((None, 4096, 65536)))
    # Memory faults from a stream of their own: the draws above replay as before.
    # A trial draws a subset of the memory kinds asked for: with all of them at once,
    # a full tmpfs would leave no memory snapshot for the others to meet.
    memory_rng = random.Random(s ^ 0x6D656D)
    asked = [kind for kind in MEMORY_FAULTS if kind in kinds]
    drawn = memory_rng.sample(asked, memory_rng.randint(1, len(asked))) if asked else []
    memory = [MemoryFault(kind, round(memory_rng.uniform(0.1, 0.6) * horizon_s, 2))
              for kind in asked if kind in drawn]
    if not process_kinds and "memory_corrupt" in drawn:
        # A corrupt memory snapshot matters to a restart: give the trial one.
        faults.append(Fault(kind="kill", at_s=round(memory_rng.uniform(0.6, 0.9) * horizon_s,
                                                    2), target="worker",
                            rank=memory_rng.randrange(world_size)))
    node = (draw_node_fault(random.Random(s ^ 0x6E6F6465), horizon_s, nodes, replace=replace,
                            steps=steps, step_s=step_s) if "node" in kinds else None)
    if node is not None and "join" in kinds and not node.replace:
        # From a stream of its own: the loss itself replays as without ``join``.
        rejoin_rng = random.Random(s ^ 0x6A6F696E)
        node = replace_fields(node, rejoin_after_steps=rejoin_rng.randint(1, 5))
    if node is not None and "stale" in kinds:
        # From a stream of its own too: the draws above replay as without ``stale``.
        node = replace_fields(node, keep_memory=random.Random(s ^ 0x7374616C).random() < 0.5)
    if node is not None and "degraded" in kinds:
        degraded_rng = random.Random(s ^ 0x64656772)  # its own stream, as above
        if degraded_rng.random() < 0.5:
            node = replace_fields(node, degraded=degraded_rng.randrange(nodes))
    if node is not None and "second" in kinds and (node.replace or node.rejoin_after_steps):
        second_rng = random.Random(s ^ 0x7365636F)  # its own stream, as above
        node = replace_fields(node, second=second_rng.randrange(nodes),
                              second_after_steps=second_rng.randint(1, 5))
    if node is not None and "pause" in kinds and node.rejoin_after_steps is not None:
        pause_rng = random.Random(s ^ 0x70617573)  # its own stream, as above
        if pause_rng.random() < 0.5:
            node = replace_fields(node, pause_s=round(pause_rng.uniform(1.0, 6.0), 1))
    return Schedule(trial=trial, seed=s, faults=tuple(sorted(faults, key=lambda f: f.at_s)),
                    storage=storage, memory=tuple(sorted(memory, key=lambda f: f.at_s)),
                    node=node)


def draw_node_fault(rng: random.Random, horizon_s: float, nodes: int, *, replace: bool | None,
                    steps: int, step_s: float) -> NodeFault:
    """A node loss while the job trains, at a drawn step (a small demo spends most of
    its wall time starting, and that time varies with the machine's load), or on one
    trial in six during start-up: rendezvous, process group, restore."""
    at_step: int | None = rng.randint(1, max(steps - 2, 1))
    at_s = round(rng.uniform(0.0, step_s), 3)
    if rng.random() < 1 / 6:
        at_step, at_s = None, round(rng.uniform(0.05, 0.3) * horizon_s, 2)
    victim = rng.randrange(nodes)
    drawn_replace = rng.random() < 0.5
    after_s = round(rng.uniform(0.0, 5.0), 1)
    silent = rng.random() < 0.5
    return NodeFault(at_step=at_step, at_s=at_s, node=victim,
                     replace=drawn_replace if replace is None else replace,
                     replace_after_s=after_s, silent=silent,
                     hold_s=round(rng.uniform(4.0, 10.0), 1) if silent else 0.0)
