"""``elastictrain chaos --faults node``: a job on several agents, one node lost a trial.

The clean run and every trial run the demo (or a user's script) on ``--nodes`` agents
(:mod:`.nodes`) with the memory tier on (``--memory-every``), each agent with its own
memory directory, and one durable storage. The demo writes per-step sample records;
a script's steps are read from its ``train.progress`` events instead
(:mod:`.stepmarks`). A trial loses one node at a
drawn time (:class:`~elastictrain.chaos.schedule.NodeFault`): abruptly or silently,
then replaced by a new agent with an empty memory directory (the job is ``--nnodes
N:N`` and waits for it) or not (``--nnodes N-1:N``: it goes on one node smaller; with
``join`` among the kinds such a node comes back later, and the job grows back).

Checks, besides the single-agent ones that still apply (snapshots verify, nothing left
running, no credential in any file, node memory private and emptied at the end):
every launcher the harness did not kill exited 0; the final parameters equal the
clean run's when every surviving step ran at the full world size; each sample trained
exactly once (the demo only: a script records no samples); each resume read from the
newest complete copy and lost no more steps than allowed (:mod:`.nodechecks`, which
takes what the job can do across nodes as a parameter: found from the settings, see
:func:`peer_memory`; a script's snapshot intervals come from its clean run).
"""

from __future__ import annotations

import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from dataclasses import replace as replace_fields
from pathlib import Path
from typing import Any

from elastictrain.chaos import checks
from elastictrain.chaos.dataonce import check_exactly_once, final_world_sizes, read_records
from elastictrain.chaos.job import events_of, processes_with_marker, signal_pid, trial_env
from elastictrain.chaos.nodechecks import (
    NODE_KEY,
    Expectation,
    Loss,
    NodeLife,
    check_agents,
    check_node_resumes,
)
from elastictrain.chaos.nodes import Node, NodeJob
from elastictrain.chaos.runner import ChaosOptions, ChaosReport, TrialResult, script_command
from elastictrain.chaos.schedule import NodeFault, Schedule, make_schedule
from elastictrain.chaos.stepmarks import (
    PROGRESS_EVERY_S,
    final_world_sizes_of,
    step_marks,
    unmarked_steps,
    widest_gap,
)
from elastictrain.core.config import load_settings
from elastictrain.core.errors import ConfigError, ElasticTrainError
from elastictrain.core.shm import user_root_in
from elastictrain.launcher.spawn import DEFAULT_RDZV_CONF, LaunchSpec
from elastictrain.storage import open_store
from elastictrain.view.tail import EventTail

_POLL_S = 0.05
# A replacement that never got to join (the others had ended the run already) is
# stopped this long after the last of the others exited.
ORPHAN_GRACE_S = 30.0
# A pause lasts until the paused nodes' agents restart for the joining node (at most
# PAUSE_JOIN_WAIT_S), then ``pause_s`` more; the workers' watchdogs run longer than all
# of it, by PAUSE_WATCHDOG_MARGIN_S.
PAUSE_JOIN_WAIT_S = 30.0
PAUSE_WATCHDOG_MARGIN_S = 5.0


def peer_memory() -> bool:
    """Whether this elastictrain restores memory snapshots from peer nodes and rescues
    across nodes: the ``snapshot.memory_replicas`` setting exists and is above 0."""
    return int(getattr(load_settings().snapshot, "memory_replicas", 0) or 0) > 0


def validate_node_options(opts: ChaosOptions) -> None:
    if opts.nodes not in (2, 3):
        raise ConfigError(f"--nodes={opts.nodes}: node faults need 2 or 3 agents")
    if opts.memory_every < 1 or opts.samples < 1:
        raise ConfigError("--memory-every and --samples must be >= 1")


def run_node_chaos(opts: ChaosOptions, progress: Any = sys.stderr) -> ChaosReport:
    """The clean run on ``opts.nodes`` agents, then the trials, each losing a node."""
    opts.validate()
    validate_node_options(opts)
    workdir = Path(opts.workdir or tempfile.mkdtemp(prefix="elastictrain-chaos-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    secret = f"chaos-secret-{uuid.uuid4().hex}"
    clean = NodeTrial(opts, workdir / "clean", secret, None)
    clean.execute()
    digest = checks.final_digest(clean.events())
    if any(c != [0] for c in clean.exit_codes().values()) or digest is None:
        raise ElasticTrainError(f"the clean run failed (launcher exit codes "
                                f"{clean.exit_codes()}); see {workdir / 'clean'}")
    expect = expectation(opts, clean.events())
    progress.write(f"clean run on {opts.nodes} nodes: {clean.wall_s:.1f}s, digest "
                   f"{digest[:12]}…; memory every {expect.memory_every}, durable every "
                   f"{expect.durable_every} steps; peer memory "
                   f"{'expected' if expect.peer_restore else 'not expected'}; "
                   f"workdir {workdir}\n")
    grace_s = float(load_settings().launch.shutdown_timeout_s)
    results = []
    for trial in range(opts.first, opts.first + opts.trials):
        schedule = make_schedule(opts.seed, trial, opts.faults, clean.wall_s,
                                 opts.nproc * opts.nodes, opts.nodes, replace=opts.replace,
                                 steps=clean.total_steps(), step_s=clean.step_s())
        run = NodeTrial(opts, workdir / f"trial-{trial:04d}", secret, schedule,
                        timeout_s=max(180.0, 8 * clean.wall_s) + grace_s)
        run.execute()
        result = run.judge(digest, expect, secret)
        results.append(result)
        progress.write(f"trial {trial} seed {schedule.seed}: {schedule.describe()} -> "
                       f"{'pass' if result.passed else 'FAIL: ' + '; '.join(result.failures)}"
                       f" ({result.wall_s:.1f}s; replay: --seed {opts.seed} --first {trial} "
                       "--trials 1)\n")
    return ChaosReport(digest, round(clean.wall_s, 2), expect.durable_every, str(workdir),
                       results)


def expectation(opts: ChaosOptions, clean_events: list[dict[str, Any]]) -> Expectation:
    """What the job's resumes may lose: the demo's intervals are its options; a script
    sets its own durable interval (and may set the memory tier's), so its clean run's
    widest gaps between commits are its intervals."""
    peer = opts.peer if opts.peer is not None else peer_memory()
    if opts.script is None:
        return Expectation(memory_every=opts.memory_every, durable_every=opts.snapshot_every,
                           peer_restore=peer, cross_node_rescue=peer)
    # The checks need a step mark of every step, and the script's durable interval.
    missing = unmarked_steps(step_marks(clean_events))
    if missing:
        raise ElasticTrainError(
            f"the clean run of {opts.script} left no train.progress event for steps "
            f"{missing[:10]}: node faults on a script read its steps from them; fix: let "
            "the environment set snapshot.progress_every_s (do not pass it in the config "
            "the script gives SnapshotManager)")
    durable = widest_gap(clean_events, durable_only=True)
    if durable is None:
        raise ElasticTrainError(
            f"the clean run of {opts.script} committed no durable snapshot: its interval "
            "bounds the steps a resume may lose; fix: save snapshots (SnapshotManager "
            "every_steps) to {storage}")
    memory = widest_gap(clean_events, durable_only=False) or opts.memory_every
    return Expectation(memory_every=memory, durable_every=durable, peer_restore=peer,
                       cross_node_rescue=peer)


@dataclass
class Pause:
    """Workers paused (SIGSTOP) as a node joins: ``pids``, on the nodes whose events are
    in ``events_dirs``, since ``since`` (epoch s). They continue ``pause_s`` after an
    agent there restarts for the join (or ``wait_until``, monotonic, passes first)."""

    pids: list[int]
    events_dirs: list[Path]
    since: float
    wait_until: float
    pause_s: float
    until: float | None = None  # monotonic: when they continue, once the join was seen
    _checked: float = 0.0

    def join_seen(self) -> bool:
        """Whether a paused node's agent restarted for a membership change (read at
        most every 0.25 s: each read parses the nodes' logs)."""
        now = time.monotonic()
        if now - self._checked < 0.25:
            return False
        self._checked = now
        return any(e.get("event") == "agent.restart" and e.get("reason") == "membership_change"
                   and float(e.get("ts") or 0.0) > self.since
                   for d in self.events_dirs for e in events_of(d))


class NodeTrial:
    """One job on several agents (clean, or a trial losing one node)."""

    def __init__(self, opts: ChaosOptions, workdir: Path, secret: str,
                 schedule: Schedule | None, timeout_s: float = 900.0) -> None:
        self.opts, self.schedule, self.timeout_s = opts, schedule, timeout_s
        self.workdir = workdir
        self.storage = workdir / "storage"
        self.records = workdir / "records"
        workdir.mkdir(parents=True, exist_ok=True)
        fault = schedule.node if schedule is not None else None
        # Replaced (or no loss): the world size must come back, so N:N; else N-1:N.
        lo = opts.nodes - 1 if fault is not None and not fault.replace else opts.nodes
        self.nnodes = f"{lo}:{opts.nodes}"
        self.rdzv_id = f"chaos-{uuid.uuid4().hex[:8]}"
        self.job = NodeJob(workdir, uuid.uuid4().hex, self._env(secret), self._spec)
        self.injected: list[str] = []
        self.lost: set[str] = set()
        self.losses: list[Loss] = []  # the first, and a second (``second``)
        # A pause in training while the lost node rejoins (``pause``): the paused PIDs
        # and when they continue; the pauses whose join may cost no step (epoch s).
        self._paused: Pause | None = None
        self.strict_joins: list[float] = []
        self.timed_out = False
        self.leftovers: list[int] = []
        self.wall_s = 0.0
        # A script's step marks as they come (_first_marked): each poll reads only what
        # the nodes' event logs gained, not every event again.
        self._tails: dict[str, EventTail] = {}
        self._first_marked: dict[int, float] = {}  # step -> when a rank first marked it

    def _spec(self, node_dir: Path, port: int) -> LaunchSpec:
        opts, events = self.opts, str(node_dir / "events")
        if opts.script is None:
            args = [f"--storage={self.storage}", f"--steps={opts.steps}",
                    f"--snapshot-every={opts.snapshot_every}",
                    f"--memory-every={opts.memory_every}", f"--samples={opts.samples}",
                    f"--record-samples={self.records}", f"--events-dir={events}"]
            module, script = "elastictrain.demo.worker", None
        else:
            module, (script, args) = None, script_command(opts, self.storage)
        return LaunchSpec(nproc_per_node=opts.nproc, module=module, script=script,
                          script_args=args, nnodes=self.nnodes, max_restarts=opts.max_restarts,
                          rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=self.rdzv_id,
                          rdzv_conf=f"{DEFAULT_RDZV_CONF},is_host=0",
                          log_dir=str(node_dir / "torchelastic"), events_dir=events)

    def _env(self, secret: str) -> dict[str, str]:
        schedule = self.schedule
        fault = schedule.node if schedule is not None else None
        # A pause (SIGSTOP) stops a worker's watchdog thread with its training thread:
        # a timeout under the pause would fire as they resume, before the next step.
        watchdog_s = max(self.opts.watchdog_timeout_s,
                         PAUSE_JOIN_WAIT_S + fault.pause_s + PAUSE_WATCHDOG_MARGIN_S
                         if fault is not None and fault.pause_s else 0.0)
        env = trial_env(str(self.storage), secret, watchdog_s,
                        schedule.storage if schedule is not None else None,
                        schedule.seed if schedule is not None else 0)
        if self.opts.script is not None:
            # The demo takes these as options; a script reads them from the settings.
            # The memory tier, as for the demo; a train.progress event every step: the
            # step marks that stand in for the demo's records (chaos/stepmarks.py).
            env["ELASTICTRAIN_SNAPSHOT__MEMORY_EVERY"] = str(self.opts.memory_every)
            env["ELASTICTRAIN_SNAPSHOT__PROGRESS_EVERY_S"] = PROGRESS_EVERY_S
        return env

    def events(self) -> list[dict[str, Any]]:
        """Every event of the job, each tagged with the node incarnation it came from."""
        found = [{**e, NODE_KEY: n.name} for n in self.job.nodes
                 for e in events_of(n.job.events_dir)]
        return sorted(found, key=lambda e: float(e.get("ts") or 0.0))

    def marks(self, events: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Each step each rank trained (``ts``, ``step``), in time order: the demo's
        sample records, or a script's step marks (from ``events`` when already read)."""
        if self.opts.script is None:
            return read_records(self.records)
        return step_marks(self.events() if events is None else events)

    def total_steps(self) -> int:
        """The steps of this run (the clean run's: at full size): the demo's option, a
        script's highest marked step."""
        if self.opts.script is None:
            return self.opts.steps
        return max((int(m["step"]) for m in self.marks()), default=1)

    def step_s(self) -> float:
        """Seconds per step of this run (first to last recorded step)."""
        ts = [float(r["ts"]) for r in self.marks()]
        return (max(ts) - min(ts)) / max(self.total_steps() - 1, 1) if ts else 0.1

    def exit_codes(self) -> dict[str, list[int]]:
        return {n.name: list(n.job.exit_codes) for n in self.job.nodes}

    def execute(self) -> None:
        fault = self.schedule.node if self.schedule is not None else None
        started = time.monotonic()
        # The loss goes wait (for its time) → frozen (until the kill) → replace (until
        # the new agent starts) → done; without a fault, done from the start.
        phase, phase_at = ("wait", None) if fault is not None else ("done", None)
        victim: Node | None = None
        back_ts = 0.0  # when the lost node came back (replaced or rejoining)
        orphan_since: float | None = None
        try:
            self.job.start(self.opts.nodes, fault.degraded if fault is not None else None)
            if fault is not None and fault.degraded is not None:
                self.injected.append(f"degraded: node{fault.degraded} started on a refused "
                                     "shared-memory root (no rescue marks)")
            clock = time.monotonic()  # the fault's time counts from the agents' start
            while not self.timed_out:
                now = time.monotonic()
                running = self.job.running()
                if phase == "wait" and fault is not None:
                    phase_at = phase_at if phase_at is not None else self._due(fault, clock)
                    if phase_at is not None and now >= phase_at:
                        victim = self._lose(fault)
                        phase, phase_at = (("frozen", now + fault.hold_s) if victim is not None
                                           else ("done", None))
                elif phase == "frozen" and fault is not None and victim is not None \
                        and phase_at is not None and now >= phase_at:
                    pids = self.job.kill(victim)
                    self.injected[-1] += f", SIGKILL {len(pids)} processes"
                    if fault.replace:
                        phase, phase_at = "replace", time.monotonic() + fault.replace_after_s
                    else:  # a rejoin, when drawn, once the smaller job has trained
                        phase = "rejoin" if fault.rejoin_after_steps is not None else "done"
                        phase_at = None
                elif phase == "rejoin" and fault is not None and self.losses \
                        and self._trained_since(self.losses[0].ts) >= (
                            fault.rejoin_after_steps or 0):
                    if fault.pause_s:
                        self._pause(fault)
                    phase, back_ts = self._back(fault, rejoin=True)
                elif phase == "replace" and fault is not None and phase_at is not None \
                        and now >= phase_at:
                    phase, back_ts = self._back(fault)
                    phase_at = None
                elif phase == "second" and fault is not None and fault.second is not None \
                        and self._second_due(fault, back_ts):
                    # The second loss: abrupt, its memory wiped, replaced at once.
                    fault = replace_fields(fault, node=fault.second, silent=False, hold_s=0.0,
                                           keep_memory=False, replace=True,
                                           replace_after_s=0.0, second=None)
                    victim = self._lose(fault, second=True)
                    phase, phase_at = ("frozen", now) if victim is not None else ("done", None)
                if not running and phase in ("wait", "rejoin", "second", "done"):
                    break
                self._continue_paused()
                orphan_since = self._stop_orphan(running, orphan_since)
                self.timed_out = time.monotonic() - started > self.timeout_s
                time.sleep(_POLL_S)  # polling the agents and the fault clock
            if phase == "wait" and fault is not None:
                self.injected.append(f"{fault.describe()} not injected (job done)")
            if phase == "rejoin":
                self.injected.append("rejoin: none started (the job ended first)")
            if phase == "second":
                self.injected.append("second loss: not injected (the job ended first)")
            if not self.timed_out:
                self.leftovers = self._wait_gone(10.0)
        finally:
            self._continue_paused(at_once=True)
            self.job.close()
            self.wall_s = time.monotonic() - started

    def _pause(self, fault: NodeFault) -> None:
        """Pause every worker of the running nodes (an evaluation, a wait for data: no
        step, the process alive) just before the lost node comes back, until their
        agents restart to take it in and ``fault.pause_s`` after: the request to save
        reaches workers that are paused. Its join may cost no step (``strict_joins``)
        where a paused node can be asked to save first: one on a refused shared-memory
        root has no rescue marks, so no request reaches it (``degraded``)."""
        running = self.job.running()
        pids = [pid for node in running for pid in node.job.worker_pids().values()]
        if not pids:
            self.injected.append("pause: not injected (no worker running)")
            return
        for pid in pids:
            signal_pid(pid, signal.SIGSTOP)
        self._paused = Pause(pids, [n.job.events_dir for n in running], time.time(),
                             time.monotonic() + PAUSE_JOIN_WAIT_S, fault.pause_s)
        names = ", ".join(node.name for node in running)
        if any(node.index != fault.degraded for node in running):
            self.strict_joins.append(time.time())
            note = "its join may cost no step"
        else:
            note = "every paused node degraded: no save request reaches it"
        self.injected.append(f"pause: SIGSTOP {len(pids)} worker(s) of {names} until their "
                             f"agents restart for node{fault.node}, then {fault.pause_s:g}s "
                             f"({note})")

    def _continue_paused(self, *, at_once: bool = False) -> None:
        """SIGCONT the paused workers once their pause is over (or now)."""
        pause = self._paused
        if pause is None:
            return
        if not at_once and pause.until is None:
            if time.monotonic() >= pause.wait_until or pause.join_seen():
                pause.until = time.monotonic() + pause.pause_s
            return
        if at_once or (pause.until is not None and time.monotonic() >= pause.until):
            for pid in pause.pids:
                signal_pid(pid, signal.SIGCONT)
            self._paused = None

    def _second_due(self, fault: NodeFault, back_ts: float) -> bool:
        """Whether the second loss is due: the node that came back resumed with the
        job (it trains in the group), and the job trained ``second_after_steps`` steps
        since."""
        if now_joined := self._resumed_since(self.job.current(fault.node), back_ts):
            return self._trained_since(now_joined) >= fault.second_after_steps
        return False

    def _resumed_since(self, node: Node, since: float) -> float | None:
        """When ``node``'s workers first resumed after ``since`` (epoch seconds)."""
        found = [float(e["ts"]) for e in events_of(node.job.events_dir)
                 if e.get("event") == "resume" and float(e.get("ts") or 0.0) > since]
        return min(found, default=None)

    def _back(self, fault: NodeFault, *, rejoin: bool = False) -> tuple[str, float]:
        """The lost node comes back; the next phase (a second loss to wait for, or
        none) and when it came back."""
        self._replace(fault.node, rejoin=rejoin)
        return ("second" if fault.second is not None else "done"), time.time()

    def _replace(self, index: int, *, rejoin: bool = False) -> None:
        """Start a new agent for node ``index``, unless the others already ended; a
        rejoin joins a job that went on without the node (it grows back)."""
        if any(n.index != index for n in self.job.running()):
            name = self.job.add(index).name
            self.injected.append(f"rejoined: {name} started, the job one node smaller"
                                 if rejoin else f"replaced: {name} started")
        else:
            self.injected.append("replacement: none started (the job had ended)")

    def _wait_gone(self, timeout_s: float) -> list[int]:
        """The job's processes (but the rendezvous store) left after ``timeout_s``."""
        store = self.job.store.proc.pid if self.job.store is not None else None
        deadline = time.monotonic() + timeout_s
        while True:
            left = [p for p in processes_with_marker(self.job.marker) if p != store]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)  # polling processes exiting, with a deadline

    def _trained_since(self, ts: float) -> int:
        """The steps some rank trained after ``ts`` (epoch seconds): the demo's sample
        records, or a script's step marks as first logged."""
        if self.opts.script is None:
            return len({int(r["step"]) for r in self.marks() if float(r["ts"]) > ts})
        self._read_new_marks()
        return sum(1 for first in self._first_marked.values() if first > ts)

    def _due(self, fault: NodeFault, clock: float) -> float | None:
        """When the loss is due (monotonic clock): ``at_s`` after the agents started,
        or after any rank first recorded step ``at_step``; None until then."""
        if fault.at_step is None:
            return clock + fault.at_s
        if self.opts.script is None:
            reached = [float(r["ts"]) for r in self.marks() if int(r["step"]) >= fault.at_step]
        else:
            self._read_new_marks()
            reached = [ts for step, ts in self._first_marked.items() if step >= fault.at_step]
        if not reached:
            return None
        return time.monotonic() - (time.time() - min(reached)) + fault.at_s

    def _read_new_marks(self) -> None:
        """Add the step marks the nodes' event logs gained since the last call."""
        for node in self.job.nodes:
            tail = self._tails.get(node.name)
            if tail is None:
                if not node.job.events_dir.is_dir():  # the launcher has not written yet
                    continue
                tail = self._tails[node.name] = EventTail(open_store(str(node.job.events_dir)))
            for mark in step_marks(tail.poll()):
                step, ts = int(mark["step"]), float(mark["ts"])
                self._first_marked[step] = min(ts, self._first_marked.get(step, ts))

    def _lose(self, fault: NodeFault, *, second: bool = False) -> Node | None:
        """Freeze node ``fault.node`` and wipe its memory, unless an agent already exited
        (the job is ending). A loss after the ranks agreed the run's end counts too: the
        other launchers must then end without it, and a replacement must find the job
        finished (docs/guide.md, the end of a multi-node run)."""
        running = self.job.running()
        if len(running) < self.opts.nodes:
            self.injected.append(f"{fault.describe()} not injected (the job was ending)")
            return None
        victim = self.job.current(fault.node)
        pids = self.job.freeze(victim)
        frozen_at = victim.lost_ts or time.time()
        if not fault.keep_memory:
            self.job.wipe(victim)
        self.lost.add(victim.name)
        self.losses.append(Loss(ts=frozen_at, silent=fault.silent))
        how = f"held {fault.hold_s:g}s" if fault.silent else "at once"
        when = ("after it came back" if second else "during start-up"
                if fault.at_step is None else f"after step {fault.at_step}")
        ended = ", after the run's agreed end" if self._end_agreed(frozen_at) else ""
        memory = "memory kept" if fault.keep_memory else "memory wiped"
        self.injected.append(f"{'second loss' if second else 'node'}: SIGSTOP {victim.name} "
                             f"{when}{ended} ({len(pids)} processes), {memory}, {how}")
        return victim

    def _end_agreed(self, before: float, events: list[dict[str, Any]] | None = None) -> bool:
        """Whether a rank logged the agreed end of the run (or its finish) before
        ``before`` (epoch seconds), in ``events`` when already read."""
        return any(e.get("event") in ("run.end_agreed", "run.finished")
                   and float(e.get("ts") or 0.0) < before
                   for e in (self.events() if events is None else events))

    def _digest_lost(self, events: list[dict[str, Any]]) -> bool:
        """The run's end was agreed and then the node of the writer (rank 0) was lost
        before it logged the final digest: the weights were final, the record is gone."""
        return (bool(self.losses) and checks.final_digest(events) is None
                and self._end_agreed(self.losses[-1].ts, events))

    def _stop_orphan(self, running: list[Node], since: float | None) -> float | None:
        """A replacement left alone (the others ended the run before it joined) waits
        in the rendezvous for peers that never come: stop it after a grace."""
        if len(running) != 1 or running[0].incarnation == 0 or self.job.store is None:
            return None
        if since is None:
            return time.monotonic()
        if time.monotonic() - since > ORPHAN_GRACE_S:
            signal_pid(running[0].job.launcher_pid or 0, signal.SIGTERM)
            self.injected.append(f"orphan: {running[0].name} stopped, alone after the others "
                                 "ended")
            return None
        return since

    def _inherited(self, node: Node) -> str | None:
        """The lost incarnation whose kept memory ``node`` started on (``stale``)."""
        fault = self.schedule.node if self.schedule is not None else None
        if fault is None or not fault.keep_memory or node.incarnation == 0:
            return None
        before = [n for n in self.job.nodes
                  if n.index == node.index and n.incarnation == node.incarnation - 1]
        return before[0].name if before and before[0].name in self.lost else None

    def _clear_kept_memory(self, events: list[dict[str, Any]]) -> None:
        """A lost node whose memory was kept (``stale``) and that never came back to
        train (none started, or the job had ended when it did) leaves it behind, as a
        machine whose agent died does: the fault's, not the run's (the next run of the
        user on that machine sweeps it once idle). Wiped before the checks that nothing
        of the run is left."""
        fault = self.schedule.node if self.schedule is not None else None
        if fault is None or not fault.keep_memory:
            return
        last = self.job.current(fault.node)
        trained = any(e.get(NODE_KEY) == last.name and e.get("event") == "worker.start"
                      for e in events)
        if last.name in self.lost or not trained:
            self.job.wipe(last)
            self.injected.append(f"kept memory wiped: node{fault.node}'s, after the run (no "
                                 "worker came back on it)")

    def judge(self, digest: str | None, expect: Expectation, secret: str) -> TrialResult:
        assert self.schedule is not None
        events = self.events()
        full = self.opts.nodes * self.opts.nproc
        finished = [e for e in events if e.get("event") == "run.finished"]
        final_step = int(finished[-1]["final_step"]) if finished else None
        lives = [NodeLife(n.name, n.started_ts, n.lost_ts, self._inherited(n))
                 for n in self.job.nodes]
        marks = self.marks(events)
        found = [
            check_agents(self.exit_codes(), self.lost, timed_out=self.timed_out),
            checks.check_snapshots(open_store(str(self.storage))),
            checks.check_replicas(events),
            check_node_resumes(events, lives, marks, expect, self.losses, self.strict_joins),
            checks.check_leftovers(self.leftovers),
            checks.check_secret(secret, self.workdir),
        ]
        if self.opts.script is None:
            found.insert(1, check_exactly_once(self.records, self.opts.samples, 0, final_step))
            sizes = final_world_sizes(self.records)
            # Process groups formed after the first, each drawing a world of its own.
            restarts = len({str(r["world"]) for r in marks}) - 1
        else:  # no samples recorded: exactly-once data is not checked for a script
            sizes = final_world_sizes_of(marks)
            # Process groups formed after the first, each restoring once on its rank 0.
            restarts = sum(1 for e in events if e.get("event") == "resume"
                           and e.get("rank") == 0) - 1
        if sizes == {full} and self._digest_lost(events):
            self.injected.append("digest not compared: the writer's node was lost after the "
                                 "agreed end, before it logged params.digest")
        elif sizes == {full}:
            found.append(checks.check_digest(events, digest))
        self._clear_kept_memory(events)
        for shm in sorted({n.shm for n in self.job.nodes}):
            found += [checks.check_private(shm, planted={user_root_in(shm)}),
                      checks.check_memory_left(shm)]
        return TrialResult(
            trial=self.schedule.trial, seed=self.schedule.seed,
            faults=self.schedule.describe(), injected=self.injected,
            restarts=max(restarts, 0),
            exit_codes=[c for codes in self.exit_codes().values() for c in codes],
            storage_faults_injected=sum(
                1 for e in events if e.get("event") == "storage.fault_injected"),
            wall_s=round(self.wall_s, 2), failures=[f for f in found if f is not None])
