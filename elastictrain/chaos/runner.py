"""``elastictrain chaos``: run a training script once cleanly, then under seeded faults.

Each run is a real job under ``elastictrain run`` (torchrun, our agent, the
launcher settings of the project), with its own storage directory, event log
and a planted fake credential in its storage options. A trial injects its
schedule (:mod:`.schedule`) by PID and relaunches the job where a fault ends
it, then :mod:`.checks` decide pass or fail. See docs/chaos.md.
"""

from __future__ import annotations

import itertools
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from elastictrain.chaos import checks
from elastictrain.chaos.job import Job, events_of, signal_pid, trial_env
from elastictrain.chaos.memfaults import MemoryNode
from elastictrain.chaos.schedule import (
    FAULT_KINDS,
    STANDBY_FAULTS,
    Fault,
    Schedule,
    make_schedule,
)
from elastictrain.core.config import load_settings
from elastictrain.core.errors import ConfigError, ElasticTrainError
from elastictrain.launcher.spawn import LaunchSpec
from elastictrain.storage import open_store

STORAGE_PLACEHOLDER = "{storage}"
_POLL_S = 0.05


@dataclass
class ChaosOptions:
    """What ``elastictrain chaos`` runs; ``script`` None means the built-in demo."""

    trials: int = 5
    seed: int = 0
    first: int = 0
    faults: tuple[str, ...] = FAULT_KINDS
    nproc: int = 2
    workdir: str | None = None
    script: str | None = None
    script_args: list[str] = field(default_factory=list)
    steps: int = 60
    snapshot_every: int = 10
    watchdog_timeout_s: float = 3.0
    max_restarts: int = 10
    # Node faults (chaos/noderun.py): agents, whether the lost node is replaced (None:
    # drawn per trial), the memory tier's interval, the demo's dataset size, and
    # whether the job restores from peers' memory (None: from the settings).
    nodes: int = 2
    replace: bool | None = None
    memory_every: int = 3
    samples: int = 600
    peer: bool | None = None

    def validate(self) -> None:
        """One line naming the option, its value and the fix."""
        for name, value, low in (("--trials", self.trials, 0), ("--first", self.first, 0),
                                 ("--nproc", self.nproc, 1), ("--steps", self.steps, 1),
                                 ("--snapshot-every", self.snapshot_every, 1)):
            if value < low:
                raise ConfigError(f"{name}={value}: must be >= {low}")
        if self.script is None:
            return
        if not Path(self.script).is_file():
            raise ConfigError(f"script {self.script!r} does not exist; fix: pass the path of "
                              "a training script after --")
        if not any(STORAGE_PLACEHOLDER in arg for arg in self.script_args):
            # Each run gets its own storage directory and the checks read the snapshots
            # there: a script writing elsewhere fails every trial with "no snapshot".
            raise ConfigError(
                f"the command after -- has no {STORAGE_PLACEHOLDER}: every run gets its own "
                "storage directory, and the checks look for the snapshots there; fix: write "
                f"{STORAGE_PLACEHOLDER} where the script takes its storage path, e.g. -- "
                f"{self.script} {STORAGE_PLACEHOLDER}")


@dataclass
class TrialResult:
    trial: int
    seed: int
    faults: str
    injected: list[str]
    restarts: int
    exit_codes: list[int]
    storage_faults_injected: int
    wall_s: float
    failures: list[str]

    @property
    def passed(self) -> bool:
        return not self.failures


@dataclass
class ChaosReport:
    clean_digest: str | None
    clean_wall_s: float
    interval: int
    workdir: str
    trials: list[TrialResult]

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.trials)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["passed"] = self.passed
        return out


def script_command(opts: ChaosOptions, storage: Path) -> tuple[str, list[str]]:
    """The user's script and its arguments, ``{storage}`` replaced by the run's storage."""
    assert opts.script is not None
    return opts.script, [a.replace(STORAGE_PLACEHOLDER, str(storage)) for a in opts.script_args]


def run_chaos(opts: ChaosOptions, progress: Any = sys.stderr) -> ChaosReport:
    """The clean run, then ``opts.trials`` trials; raises if the clean run fails."""
    opts.validate()
    workdir = Path(opts.workdir or tempfile.mkdtemp(prefix="elastictrain-chaos-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    secret = f"chaos-secret-{uuid.uuid4().hex}"  # a fake credential no output may show
    clean = _Run(opts, workdir / "clean", secret, None)
    clean.execute()
    digest = checks.final_digest(clean.events())
    if clean.job.exit_codes != [0] or digest is None:
        raise ElasticTrainError(f"the clean run failed (launcher exit codes "
                                f"{clean.job.exit_codes}); see {clean.job.workdir}/launcher.log")
    interval = _interval(clean.events(), opts)
    progress.write(f"clean run: {clean.wall_s:.1f}s, digest {digest[:12]}…, snapshot "
                   f"interval {interval} steps; workdir {workdir}\n")
    # A notice while a worker is stopped (hung) costs the launcher's whole shutdown
    # grace before it kills that worker and the relaunch can start.
    grace_s = float(load_settings().launch.shutdown_timeout_s)
    results = []
    for trial in range(opts.first, opts.first + opts.trials):
        schedule = make_schedule(opts.seed, trial, opts.faults, clean.wall_s, opts.nproc)
        run = _Run(opts, workdir / f"trial-{trial:04d}", secret, schedule,
                   timeout_s=max(120.0, 8 * clean.wall_s) + grace_s)
        try:
            run.execute()
            result = run.judge(digest, interval, secret)
        finally:
            if run.node is not None:  # never a mount left behind
                run.node.close()
        results.append(result)
        progress.write(f"trial {trial} seed {schedule.seed}: {schedule.describe()} -> "
                       f"{'pass' if result.passed else 'FAIL: ' + '; '.join(result.failures)}"
                       f" ({result.wall_s:.1f}s; replay: --seed {opts.seed} --first {trial} "
                       "--trials 1)\n")
    return ChaosReport(digest, round(clean.wall_s, 2), interval, str(workdir), results)


def _interval(events: list[dict[str, Any]], opts: ChaosOptions) -> int:
    """The demo's --snapshot-every, or the widest gap between a script's clean commits."""
    if opts.script is None:
        return opts.snapshot_every
    steps = [0, *(int(e["snapshot_step"]) for e in events
                  if e.get("event") == "snapshot.committed" and e.get("rank") == 0)]
    return max(b - a for a, b in itertools.pairwise(steps)) if len(steps) > 1 else 0


class _Run:
    """One job (clean or a trial): launch, inject the schedule, relaunch, clean up."""

    def __init__(self, opts: ChaosOptions, workdir: Path, secret: str,
                 schedule: Schedule | None, timeout_s: float = 600.0) -> None:
        self.opts, self.schedule, self.timeout_s = opts, schedule, timeout_s
        self.storage = workdir / "storage"
        workdir.mkdir(parents=True, exist_ok=True)
        kinds = {f.kind for f in schedule.memory} if schedule is not None else set()
        # A trial with a memory fault runs with the memory tier on, in a tmpfs of its own.
        self.node = MemoryNode(workdir, kinds) if kinds else None
        self.job = Job(self._spec(workdir), self._env(secret), workdir, uuid.uuid4().hex)
        self.injected: list[str] = []
        self.timed_out = False
        self.leftovers: list[int] = []
        self.launch_ts: list[float] = []
        self.wall_s = 0.0

    def _spec(self, workdir: Path) -> LaunchSpec:
        opts, events = self.opts, str(workdir / "events")
        if opts.script is None:
            args = [f"--storage={self.storage}", f"--steps={opts.steps}",
                    f"--snapshot-every={opts.snapshot_every}", f"--events-dir={events}"]
            module, script = "elastictrain.demo.worker", None
        else:
            module, (script, args) = None, script_command(opts, self.storage)
        return LaunchSpec(nproc_per_node=opts.nproc, module=module, script=script,
                          script_args=args, max_restarts=opts.max_restarts,
                          rdzv_id=f"chaos-{uuid.uuid4().hex[:8]}",
                          log_dir=str(workdir / "torchelastic"), events_dir=events)

    def _env(self, secret: str) -> dict[str, str]:
        schedule = self.schedule
        env = trial_env(str(self.storage), secret, self.opts.watchdog_timeout_s,
                        schedule.storage if schedule is not None else None,
                        schedule.seed if schedule is not None else 0)
        if self.node is not None:
            env["ELASTICTRAIN_SNAPSHOT__MEMORY_EVERY"] = "1"
            env["ELASTICTRAIN_SHM"] = str(self.node.root)
        return env

    def events(self) -> list[dict[str, Any]]:
        return events_of(self.job.events_dir)

    def execute(self) -> None:
        pending = list(self.schedule.faults) if self.schedule else []
        memory_faults = list(self.schedule.memory) if self.schedule else []
        relaunches = 0  # allowed by faults that end a job (a notice, a job kill)
        started = time.monotonic()
        try:
            self._launch()
            while not self.timed_out:
                if self.job.launcher_pid is None and self.job.poll() is not None:
                    if self.job.exit_codes[-1] != 0 and relaunches > 0:
                        relaunches -= 1
                        self._launch()
                        continue
                    break
                if pending and time.monotonic() - started >= pending[0].at_s:
                    note = self._inject(pending[0])
                    if note is not None:  # else: no target yet, try again
                        # A notice or a job kill ends the job: one relaunch each.
                        relaunches += pending.pop(0).kind in ("notice", "relaunch")
                        self.injected.append(note)
                if memory_faults and time.monotonic() - started >= memory_faults[0].at_s:
                    assert self.node is not None
                    note = self.node.inject(memory_faults[0].kind, self.job.env)
                    if note is not None:  # else: nothing to hit yet, try again
                        memory_faults.pop(0)
                        self.injected.append(note)
                self.job.poll()
                self.timed_out = time.monotonic() - started > self.timeout_s
                time.sleep(_POLL_S)  # polling the job and the fault clock
            self.injected += [f"{f.describe()} not injected (job done)" for f in pending]
            self.injected += [f"{f.describe()} not injected (job done)" for f in memory_faults]
            if not self.timed_out:
                self.leftovers = self.job.wait_gone(10)
            if self.node is not None:
                self.node.finish_neighbour(120)
        finally:
            self.job.close()
            self.wall_s = time.monotonic() - started

    def _launch(self) -> None:
        self.launch_ts.append(time.time())
        self.job.launch()

    def _inject(self, fault: Fault) -> str | None:
        """Send one fault by PID; None when its target does not exist yet."""
        job = self.job
        if job.launcher_pid is None:
            return None
        if fault.kind == "relaunch":
            pids = job.kill_job()
            return f"relaunch: SIGKILL launcher+workers {pids}"
        if fault.target == "launcher":
            signal_pid(job.launcher_pid, signal.SIGTERM)
            return f"notice: SIGTERM launcher {job.launcher_pid}"
        workers = job.worker_pids()
        if not workers:
            return None
        rank = sorted(workers)[fault.rank % len(workers)]
        if fault.kind in STANDBY_FAULTS:
            return inject_standby_fault(fault.kind, job.launcher_pid, rank, workers[rank])
        sig = {"kill": signal.SIGKILL, "notice": signal.SIGTERM, "stop": signal.SIGSTOP}[
            fault.kind]
        signal_pid(workers[rank], sig)
        return f"{fault.kind}: {sig.name} rank{rank} {workers[rank]}"

    def judge(self, digest: str | None, interval: int, secret: str) -> TrialResult:
        assert self.schedule is not None
        events = self.events()
        store = open_store(str(self.storage))
        found = [
            checks.check_completed(self.job.exit_codes, timed_out=self.timed_out),
            checks.check_digest(events, digest),
            checks.check_snapshots(store),
            checks.check_replicas(events),
            checks.check_lost_steps(events, interval, self.job.exit_codes, self.launch_ts),
            checks.check_leftovers(self.leftovers),
            checks.check_secret(secret, self.job.workdir),
        ]
        if self.node is not None:  # then the tmpfs goes (unmounted by close)
            found += [checks.check_private(self.node.root),
                      checks.check_memory_left(self.node.root),
                      checks.check_neighbour(self.node.neighbour_code)]
            self.node.close()
        attempts = {(sum(1 for t in self.launch_ts if t <= float(e["ts"])),
                     int(e["restart_count"]))
                    for e in events if e.get("event") == "worker.start"}
        return TrialResult(
            trial=self.schedule.trial, seed=self.schedule.seed,
            faults=self.schedule.describe(), injected=self.injected,
            restarts=max(len(attempts) - 1, 0), exit_codes=list(self.job.exit_codes),
            storage_faults_injected=sum(
                1 for e in events if e.get("event") == "storage.fault_injected"),
            wall_s=round(self.wall_s, 2), failures=[f for f in found if f is not None])



# -- the standby's faults (schedule.STANDBY_FAULTS) ----------------------------------------
def inject_standby_fault(kind: str, launcher_pid: int, rank: int, worker_pid: int) -> str | None:
    """``standby_stop`` / ``standby_kill``: SIGSTOP or SIGKILL the launcher's standby,
    then SIGKILL worker ``rank``, so the restart's spawn meets a stopped or dead
    standby (mid-spawn for the agent: no answer, the group starts with Popen).
    ``pid_recycle``: SIGKILL the worker and, where this runs in its own PID namespace,
    make its pid the namespace's next, so the restarted worker likely reuses it.
    None while the launcher has no standby (not started yet, or none configured)."""
    if kind == "pid_recycle":
        signal_pid(worker_pid, signal.SIGKILL)
        return f"pid_recycle: SIGKILL rank{rank} {worker_pid}, {recycle_pid(worker_pid)}"
    standby = standby_pid(launcher_pid)
    if standby is None:
        return None
    sig = signal.SIGSTOP if kind == "standby_stop" else signal.SIGKILL
    signal_pid(standby, sig)
    signal_pid(worker_pid, signal.SIGKILL)
    return f"{kind}: {sig.name} standby {standby}, SIGKILL rank{rank} {worker_pid}"


def standby_pid(launcher_pid: int) -> int | None:
    """The standby of the agent in ``launcher_pid`` (its title names the agent)."""
    title = f"elastictrain standby (agent {launcher_pid})".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "cmdline").read_bytes().startswith(title):
                return int(entry.name)
        except OSError:
            continue  # ended during the walk
    return None


def in_child_pid_namespace() -> bool:
    """True inside a PID namespace other than the machine's: ``NSpid`` lists more than
    one pid (a /proc of an outer namespace), or this /proc has no kernel thread daemon
    at pid 2 (``unshare --pid --fork --mount-proc``: only the namespace's processes)."""
    status = Path("/proc/self/status").read_text()
    nspids = next((line.split()[1:] for line in status.splitlines()
                   if line.startswith("NSpid:")), [])
    try:
        kthreadd = Path("/proc/2/comm").read_text().strip() == "kthreadd"
    except OSError:
        kthreadd = False
    return len(nspids) >= 2 or not kthreadd


def recycle_pid(pid: int, timeout_s: float = 5.0) -> str:
    """Make ``pid`` the next pid handed out, once its process is reaped; only inside a
    PID namespace of our own: elsewhere the next pid is the whole machine's. Says what
    it did."""
    if not in_child_pid_namespace():
        return "pid recycling not arranged (not in a PID namespace of its own)"
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists():  # the pid is reusable once its process is reaped
        if time.monotonic() > deadline:
            return f"pid recycling not arranged ({pid} not reaped within {timeout_s:g}s)"
        time.sleep(_POLL_S)  # polling the process table, as the runner polls its job
    try:
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
    except OSError as exc:
        return f"pid recycling not arranged ({exc})"
    return f"next pid set to {pid}"
