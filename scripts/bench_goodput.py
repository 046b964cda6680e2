"""Goodput of the demo under random worker kills: fixed snapshot intervals vs ``auto`` vs
``auto`` + the node-memory tier, beside the bound 1 - sqrt(2C/MTBF) - R/MTBF.

Each configuration runs the demo (``elastictrain run -m elastictrain.demo.worker``, CPU,
``--nproc`` workers, its own storage and events) for ``--wall-s`` seconds from its first
step, while a seeded failure process SIGKILLs a random worker (by the PID of its
``worker.start`` event) at exponential inter-arrival times of mean ``--mtbf-s``; torchrun
restarts the job. Every configuration gets the same kill times and ranks. At the end
the launcher gets SIGTERM (final snapshot, exit 75). Figures per configuration:

- goodput: productive / wall from ``elastictrain goodput EVENTS --json`` (its split);
- C: mean ``snapshot.staged`` duration on rank 0 (what the loop waits for per snapshot,
  back-pressure included), all tiers, and per tier;
- R: mean kill -> first step of the resumed attempt (rank 0's ``demo.first_step``);
- the bound 1 - sqrt(2C/MTBF) - R/MTBF, with MTBF the realised one (wall / kills) and
  the nominal one; goodput / bound and goodput / the best fixed interval's goodput.

With several ``--seeds`` every configuration runs under each seed's schedule, and the
table pools them: each part of the split summed over the runs over their summed wall
time, C and R averaged over all snapshots and recoveries, the bound from those and
the realised MTBF of all runs; ``/best fixed`` is the pooled ratio with the seeds' own
ratios [min-max] beside it. A handful of kills per run makes one seed's lost work a
matter of where the kills land against the snapshots; pooling seeds averages that out.

With ``--nodes N`` (2 or 3) the demo runs on N agents on this machine, ``--nproc``
workers each, as ``elastictrain chaos --faults node`` runs them (a rendezvous store of
its own, a memory directory per node on /dev/shm, one events directory they share as
they would share durable storage), and ``--node-loss-share P`` makes that share of the
failures a whole node lost instead of one worker: every process of the node holding
the drawn rank's agent SIGKILLed, its memory directory wiped, and a new agent started
in its place after ``--replace-after-s``. Which failures are node losses is drawn from
a stream of its own, so a seed's times and ranks stay what they were.

The machine's other work makes every figure noisy: load averages and the flag are in
the report. Figures and how to read them: docs/goodput.md.

    python scripts/bench_goodput.py --wall-s 180 --mtbf-s 60
    python scripts/bench_goodput.py --wall-s 180 --seeds 0 1 2 --json pooled.json
    python scripts/bench_goodput.py --configs fixed:40 auto auto+memory:1 --json
    python scripts/bench_goodput.py --nodes 2 --nproc 1 --node-loss-share 0.5 \
        --configs auto+memory:auto --seeds 0 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib import load_average, noisy, write_json

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # elastictrain from this checkout, like the workers

from elastictrain.chaos.nodes import NodeJob  # noqa: E402
from elastictrain.launcher.spawn import DEFAULT_RDZV_CONF, LaunchSpec, start_torchrun  # noqa: E402
from elastictrain.runlog.events_read import read_events  # noqa: E402

WORKER = "elastictrain.demo.worker"
DEFAULT_CONFIGS = ["fixed:20", "fixed:40", "fixed:80", "auto", "auto+memory:auto"]
STOP_TIMEOUT_S = 120.0  # SIGTERM -> launcher exit (final snapshot, a restart in flight)
START_TIMEOUT_S = 300.0  # launch -> first step, on a busy machine


@dataclass(frozen=True)
class Kill:
    """One failure: ``at_s`` after the first step, on ``rank``; ``node``: the whole node
    of that rank's agent is lost, not only the worker."""

    at_s: float
    rank: int
    node: bool = False


@dataclass
class Config:
    """One configuration: its name (``fixed:N``, ``auto``, ``+memory:M``) and worker args."""

    name: str
    worker_args: list[str] = field(default_factory=list)

    @property
    def fixed(self) -> bool:
        return self.name.startswith("fixed:") and "+" not in self.name


def parse_config(text: str) -> Config:
    """``fixed:N``, ``auto``, each optionally ``+memory:M`` (``M``: steps or ``auto``).

    Raises:
        SystemExit: anything else (names the value and the fix).
    """
    args: list[str] = []
    parts = text.split("+")
    for i, part in enumerate(parts):
        kind, _, value = part.partition(":")
        if i == 0 and kind == "auto" and not value:
            args.append("--snapshot-every=auto")
        elif i == 0 and kind == "fixed" and value.isdigit() and int(value) >= 1:
            args.append(f"--snapshot-every={int(value)}")
        elif i > 0 and kind == "memory" and value.isdigit() and int(value) >= 1:
            args.append(f"--memory-every={int(value)}")
        elif i > 0 and kind == "memory" and value == "auto":
            args.append("--memory-every=auto")
        else:
            raise SystemExit(f"--configs {text!r}: expected fixed:N or auto, optionally "
                             "followed by +memory:M (N, M whole numbers >= 1, M also "
                             "auto); fix: e.g. fixed:40 auto auto+memory:auto")
    return Config(text, args)


def failure_schedule(seed: int, mtbf_s: float, wall_s: float, nproc: int,
                     node_share: float = 0.0) -> list[Kill]:
    """Exponential inter-arrival times of mean ``mtbf_s`` within ``wall_s``, the rank
    each kill hits, and (a stream of its own) whether it takes the whole node: the same
    for every configuration of one seed."""
    rng, nodes = random.Random(seed), random.Random(seed ^ 0x6E6F6465)
    kills, at = [], rng.expovariate(1.0 / mtbf_s)
    while at < wall_s:
        kills.append(Kill(round(at, 3), rng.randrange(nproc), nodes.random() < node_share))
        at += rng.expovariate(1.0 / mtbf_s)
    return kills


# ---------------------------------------------------------------------------------------
# one configuration's run
# ---------------------------------------------------------------------------------------
class DemoJob:
    """The demo under ``elastictrain run`` with restarts, and its event files."""

    def __init__(self, work: Path, config: Config, nproc: int, kills: int, seed: int,
                 durable_latency_s: float = 0.0) -> None:
        self.run_id = f"goodput-{uuid.uuid4().hex[:8]}"
        self.storage = work / "storage"
        self.events = work / "events" / self.run_id
        self.events.mkdir(parents=True)
        self.memory = Path("/dev/shm") / f"bench-goodput-{self.run_id}"
        worker_args = [f"--storage={self.storage}", "--steps=100000000", "--keep=2",
                       f"--seed={seed}", f"--events-dir={self.events}", *config.worker_args]
        self.spec = LaunchSpec(nproc_per_node=nproc, module=WORKER, script_args=worker_args,
                               max_restarts=kills + 5, rdzv_id=self.run_id,
                               log_dir=str(self.events / "torchelastic"),
                               events_dir=str(self.events))
        self.env = {"ELASTICTRAIN_STORAGE__URL": str(self.storage), "OMP_NUM_THREADS": "1",
                    "ELASTICTRAIN_SNAPSHOT__MEMORY_DIR": str(self.memory),
                    "PYTHONPATH": os.pathsep.join(filter(None, [
                        str(REPO), os.environ.get("PYTHONPATH", "")]))}
        if durable_latency_s:
            # The durable tier only (the memory tier opens its own store, never wrapped):
            # every storage operation waits first, as a store a network away does.
            self.env["ELASTICTRAIN_STORAGE__FAULTS__LATENCY_S"] = str(durable_latency_s)
        self.proc: subprocess.Popen[bytes] | None = None
        self.killed: set[int] = set()

    def start(self) -> None:
        with open(self.events / "launcher.log", "w") as out:
            self.proc = start_torchrun(self.spec, stdout=out, extra_env=self.env)

    def rank0_events(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for path in sorted(self.events.glob("attempt*-rank0.jsonl")):
            found += read_events(path)
        return found

    def worker_starts(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for path in sorted(self.events.glob("attempt*-rank*.jsonl")):
            found += [e for e in read_events(path) if e.get("event") == "worker.start"]
        return found

    def first_step_ts(self, restart_count: int) -> float | None:
        """When rank 0 of this attempt finished its first step (``demo.first_step``)."""
        return next((float(e["ts"]) for e in self.rank0_events()
                     if e.get("event") == "demo.first_step"
                     and e.get("restart_count") == restart_count), None)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_for(self, predicate: Any, timeout: float, what: str) -> Any:
        """Poll ``predicate`` every 20 ms; fail if the launcher exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if not self.running():
                raise RuntimeError(f"the launcher exited before {what}; see "
                                   f"{self.events / 'launcher.log'} (--keep)")
            time.sleep(0.02)
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")

    def victim(self, rank: int) -> dict[str, Any] | None:
        """The live worker of ``rank`` in the newest attempt (None while it restarts)."""
        starts = [e for e in self.worker_starts() if int(e["pid"]) not in self.killed]
        if not starts:
            return None
        newest = max(int(e["restart_count"]) for e in starts)
        return next((e for e in starts if int(e["restart_count"]) == newest
                     and e.get("rank") == rank and _is_worker(int(e["pid"]))), None)

    def kill(self, rank: int) -> dict[str, Any]:
        """SIGKILL ``rank``'s worker by PID; a kill due during a restart waits for the new
        worker to start (its PID is first known then)."""
        target = self.wait_for(lambda: self.victim(rank), START_TIMEOUT_S, f"rank {rank}")
        pid = int(target["pid"])
        os.kill(pid, signal.SIGKILL)
        self.killed.add(pid)
        return {"ts": time.time(), "rank": rank, "pid": pid,
                "restart_count": int(target["restart_count"])}

    def stop(self) -> int | None:
        """SIGTERM to the launcher (final snapshot, exit 75); SIGKILL what is left."""
        code = None
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=60)
        elif self.proc is not None:
            code = self.proc.returncode
        for event in self.worker_starts():
            if _is_worker(int(event["pid"]), str(self.events)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(event["pid"]), signal.SIGKILL)
        shutil.rmtree(self.memory, ignore_errors=True)
        return code


class NodesDemoJob(DemoJob):
    """The demo on ``nodes`` agents (elastictrain/chaos/nodes.py) sharing one events
    directory, each with its own memory directory on /dev/shm; a node can be lost."""

    def __init__(self, work: Path, config: Config, nproc: int, kills: int, seed: int,
                 nodes: int, replace_after_s: float, durable_latency_s: float = 0.0) -> None:
        super().__init__(work, config, nproc, kills, seed, durable_latency_s)
        self.env.pop("ELASTICTRAIN_SNAPSHOT__MEMORY_DIR")  # one per node, under its shm
        self.nodes, self.replace_after_s = nodes, replace_after_s
        self.cluster = NodeJob(work / "nodes", uuid.uuid4().hex, self.env, self._spec_for,
                               shm_base=self.memory)

    def _spec_for(self, node_dir: Path, port: int) -> LaunchSpec:
        return LaunchSpec(nproc_per_node=self.spec.nproc_per_node, module=WORKER,
                          script_args=self.spec.script_args,
                          nnodes=f"{self.nodes}:{self.nodes}",
                          max_restarts=self.spec.max_restarts,
                          rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=self.run_id,
                          rdzv_conf=f"{DEFAULT_RDZV_CONF},is_host=0",
                          log_dir=str(node_dir / "torchelastic"), events_dir=str(self.events))

    def start(self) -> None:
        (self.events.parent.parent / "nodes").mkdir(parents=True, exist_ok=True)
        self.cluster.start(self.nodes)

    def running(self) -> bool:
        return bool(self.cluster.running())

    def first_step_ts(self, restart_count: int) -> float | None:
        """The first step of the job: any rank 0's first ``demo.first_step``."""
        return next((float(e["ts"]) for e in self.rank0_events()
                     if e.get("event") == "demo.first_step"), None)

    def victim(self, rank: int) -> dict[str, Any] | None:
        """The live worker of ``rank`` that started last (restart counts differ by node:
        a new node's agent counts from 0)."""
        live = [e for e in self.worker_starts() if e.get("rank") == rank
                and int(e["pid"]) not in self.killed and _is_worker(int(e["pid"]))]
        return max(live, key=lambda e: float(e["ts"]), default=None)

    def lose_node(self, rank: int) -> dict[str, Any]:
        """Lose the node whose agent runs ``rank``'s worker; a new agent takes its place
        ``replace_after_s`` later (the failure process's clock waits meanwhile)."""
        target = self.wait_for(lambda: self.victim(rank), START_TIMEOUT_S, f"rank {rank}")
        pid = int(target["pid"])
        node = next(n for n in self.cluster.running() if pid in _marked(n.job.marker))
        self.cluster.freeze(node)
        self.cluster.kill(node)
        killed_ts = time.time()
        time.sleep(self.replace_after_s)  # the failure process's clock: a new machine
        self.cluster.add(node.index)
        return {"ts": killed_ts, "rank": rank, "pid": pid, "node": node.name,
                "restart_count": int(target["restart_count"])}

    def stop(self) -> int | None:
        """SIGTERM to every launcher (final snapshot, exit 75); kill what is left."""
        for node in self.cluster.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.job.launcher_pid or 0, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self.cluster.running() and time.monotonic() < deadline:
            time.sleep(0.1)  # launchers finishing their final snapshot
        codes = [n.job.poll() for n in self.cluster.nodes if n.lost_ts is None]
        self.cluster.close()
        return next((c for c in codes if c not in (None, 0)), codes[-1] if codes else None)


def _marked(marker: str) -> set[int]:
    from elastictrain.chaos.job import processes_with_marker

    return set(processes_with_marker(marker))


def _is_worker(pid: int, needle: str = WORKER) -> bool:
    """``pid`` is still a demo worker (not a recycled PID): its command line says so."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return WORKER in cmdline and needle in cmdline


def run_config(config: Config, kills: list[Kill], seed: int,
               args: argparse.Namespace) -> dict[str, Any]:
    """Run one configuration under the failure schedule of ``seed`` and measure it."""
    work = Path(tempfile.mkdtemp(prefix="bench-goodput-", dir=args.workdir))
    job = (DemoJob(work, config, args.nproc, len(kills), seed, args.durable_latency_s)
           if args.nodes == 1 else
           NodesDemoJob(work, config, args.nproc, len(kills), seed, args.nodes,
                        args.replace_after_s, args.durable_latency_s))
    load_before = load_average()
    delivered: list[dict[str, Any]] = []
    try:
        job.start()
        t0 = job.wait_for(lambda: job.first_step_ts(0), START_TIMEOUT_S, "the first step")
        for kill in kills:
            _sleep_until(t0 + kill.at_s, job)
            if kill.node:
                assert isinstance(job, NodesDemoJob)
                delivered.append({**job.lose_node(kill.rank), "due_s": kill.at_s})
            else:
                delivered.append({**job.kill(kill.rank), "due_s": kill.at_s})
        _sleep_until(t0 + args.wall_s, job)
        code = job.stop()
        result = measure(job, delivered, args.mtbf_s)
    finally:
        job.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    load_after = load_average()
    return {"config": config.name, "worker_args": config.worker_args, **result,
            "launcher_exit_code": code, "load_avg_before": round(load_before, 2),
            "load_avg_after": round(load_after, 2),
            "noisy": noisy(load_before, load_after, None),
            "workdir": str(work) if args.keep else None}


def _sleep_until(deadline: float, job: DemoJob) -> None:
    """The failure process's clock (wall time, not a synchronisation): wait until
    ``deadline`` (epoch seconds), failing if the launcher exits first."""
    while time.time() < deadline:
        if not job.running():
            raise RuntimeError(f"the launcher exited early; see {job.events / 'launcher.log'}")
        time.sleep(min(0.05, max(deadline - time.time(), 0.0)))


# ---------------------------------------------------------------------------------------
# figures from the events
# ---------------------------------------------------------------------------------------
def goodput_json(events: Path) -> dict[str, Any]:
    """``elastictrain goodput EVENTS --json``, as a user runs it."""
    out = subprocess.run([sys.executable, "-m", "elastictrain.cli", "goodput", str(events),
                          "--json"], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    return dict(json.loads(out.stdout))


def snapshot_cost(rank0: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean blocking per snapshot (``snapshot.staged`` duration, which starts before the
    back-pressure wait), over all tiers and per tier, with counts."""
    by_tier: dict[str, list[float]] = {}
    for e in rank0:
        if e.get("event") == "snapshot.staged":
            by_tier.setdefault(str(e.get("tier") or "durable"), []).append(float(e["duration_s"]))
    every = [d for durations in by_tier.values() for d in durations]
    return {"mean_s": sum(every) / len(every) if every else None, "snapshots": len(every),
            "by_tier": {t: {"mean_s": sum(d) / len(d), "snapshots": len(d)}
                        for t, d in sorted(by_tier.items())}}


def recoveries(job: DemoJob, delivered: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kill: kill -> rank 0's first step after it, and the steps lost (by time, not
    restart count: on several nodes a new node's agent counts its restarts from 0)."""
    rank0 = sorted(job.rank0_events(), key=lambda e: float(e["ts"]))
    rows = []
    for kill in delivered:
        first = next((float(e["ts"]) for e in rank0 if e.get("event") == "demo.first_step"
                      and float(e["ts"]) > kill["ts"]), None)
        resume = next((e for e in rank0 if e.get("event") == "resume"
                       and float(e["ts"]) > kill["ts"]), None)
        rows.append({"due_s": kill["due_s"], "rank": kill["rank"], "node": "node" in kill,
                     "recovery_s": None if first is None else first - kill["ts"],
                     "lost_steps": None if resume is None else resume.get("lost_steps"),
                     "tier": None if resume is None else resume.get("tier")})
    return rows


def bound(cost_s: float | None, recovery_s: float | None, mtbf_s: float) -> float | None:
    """1 - sqrt(2C/MTBF) - R/MTBF (Young/Daly's best goodput for this C, R and MTBF)."""
    if cost_s is None or recovery_s is None:
        return None
    if math.isinf(mtbf_s):
        return 1.0
    return 1.0 - math.sqrt(2.0 * cost_s / mtbf_s) - recovery_s / mtbf_s


def measure(job: DemoJob, delivered: list[dict[str, Any]], mtbf_s: float) -> dict[str, Any]:
    report = goodput_json(job.events)
    split = report["split"]
    cost = snapshot_cost(job.rank0_events())
    recs = recoveries(job, delivered)
    measured = [r["recovery_s"] for r in recs if r["recovery_s"] is not None]
    recovery = sum(measured) / len(measured) if measured else None
    realised = split["wall_s"] / len(delivered) if delivered else math.inf
    best = bound(cost["mean_s"], recovery if delivered else 0.0, realised)
    return {
        "goodput": split["fractions"].get("productive", 0.0),
        "wall_s": split["wall_s"],
        "fractions": split["fractions"],
        "seconds": split["seconds"],
        "snapshot_blocking_by_tier": split["snapshot_blocking_by_tier"],
        "final_step": report.get("final_step"),
        "kills": len(delivered),
        "cost": cost,
        "recovery_s": recovery,
        "recoveries": recs,
        "mtbf_realised_s": None if math.isinf(realised) else realised,
        "bound": best,
        "bound_nominal_mtbf": bound(cost["mean_s"], recovery, mtbf_s),
    }


# ---------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------
def compare(results: list[dict[str, Any]]) -> None:
    """Add goodput / bound, goodput / the best fixed interval's goodput, and the share of
    wall time the interval decides (lost work + snapshot blocking): restart times vary by
    seconds from one kill to the next on a busy machine, and they weigh in goodput alone."""
    for r in results:
        r["interval_loss"] = round(r["fractions"].get("lost_work", 0.0)
                                   + r["fractions"].get("snapshot_blocking", 0.0), 4)
    fixed = [r for r in results if parse_config(r["config"]).fixed]
    best_fixed = max((r["goodput"] for r in fixed), default=None)
    least_loss = min((r["interval_loss"] for r in fixed), default=None)
    for r in results:
        r["ratio_to_bound"] = r["goodput"] / r["bound"] if r["bound"] else None
        r["ratio_to_best_fixed"] = r["goodput"] / best_fixed if best_fixed else None
        r["best_fixed_interval_loss"] = least_loss


def pool(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration over every seed's run: the time of each part of the
    split summed over the runs, over their summed wall time (so each second weighs the
    same), the bound from the mean C and R and the realised MTBF of all runs together,
    and each seed's own goodput and ratio to the best fixed interval for the spread."""
    rows = []
    for index, first in enumerate(runs[0]["results"]):
        same = [run["results"][index] for run in runs]
        wall = sum(r["wall_s"] for r in same)
        seconds: dict[str, float] = {}
        for r in same:
            for part, value in r["seconds"].items():
                seconds[part] = seconds.get(part, 0.0) + value
        kills = sum(r["kills"] for r in same)
        recs = [x for r in same for x in r["recoveries"]]
        measured = [x["recovery_s"] for x in recs if x["recovery_s"] is not None]
        recovery = sum(measured) / len(measured) if measured else None
        snapshots = sum(r["cost"]["snapshots"] for r in same)
        cost = (sum(r["cost"]["mean_s"] * r["cost"]["snapshots"] for r in same
                    if r["cost"]["mean_s"] is not None) / snapshots if snapshots else None)
        realised = wall / kills if kills else math.inf
        rows.append({
            "config": first["config"], "worker_args": first["worker_args"],
            "goodput": seconds.get("productive", 0.0) / wall, "wall_s": wall,
            "fractions": {part: round(value / wall, 4) for part, value in seconds.items()},
            "seconds": seconds, "kills": kills, "recoveries": recs,
            "cost": {"mean_s": cost, "snapshots": snapshots}, "recovery_s": recovery,
            "mtbf_realised_s": None if math.isinf(realised) else realised,
            "bound": bound(cost, recovery if kills else 0.0, realised),
            "per_seed": {"seeds": [run["seed"] for run in runs],
                         "goodput": [r["goodput"] for r in same],
                         "ratio_to_best_fixed": [r["ratio_to_best_fixed"] for r in same]},
            "noisy": any(r["noisy"] for r in same)})
    compare(rows)
    return rows


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: list[dict[str, Any]]) -> str:
    head = ("config", "goodput", "lost", "blocking", "restart", "kills", "C ms", "R s",
            "lost/kill", "bound", "/bound", "/best fixed", "lost+blocking")
    rows = [head]
    for r in results:
        fr = r["fractions"]
        lost = [x["lost_steps"] for x in r["recoveries"] if x["lost_steps"] is not None]
        rows.append((
            r["config"], _f(r["goodput"], ".3f"), _f(fr.get("lost_work"), ".3f"),
            _f(fr.get("snapshot_blocking"), ".3f"), _f(fr.get("restart"), ".3f"),
            str(r["kills"]), _f(r["cost"]["mean_s"] and r["cost"]["mean_s"] * 1e3, ".1f"),
            _f(r["recovery_s"], ".2f"), _f(sum(lost) / len(lost) if lost else None, ".1f"),
            _f(r["bound"], ".3f"), _f(r["ratio_to_bound"], ".3f"),
            _f(r["ratio_to_best_fixed"], ".3f") + _spread(r), _f(r["interval_loss"], ".3f")))
    widths = [max(len(row[i]) for row in rows) + 2 for i in range(len(head))]
    return "\n".join("".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def saved_tables(saved: dict[str, Any]) -> str:
    """The table of a saved ``--json`` report; of each report, under its name, for a file
    that keeps several (``{"runs": {name: report}}``)."""
    if "results" in saved:
        compare(saved["results"])
        return table(saved["results"])
    return "\n\n".join(f"{name}:\n{saved_tables(report)}"
                       for name, report in saved["runs"].items())


def _spread(row: dict[str, Any]) -> str:
    """`` [min-max]`` of the seeds' own ratios to their best fixed interval, if pooled."""
    ratios = [x for x in row.get("per_seed", {}).get("ratio_to_best_fixed", []) if x]
    return f" [{min(ratios):.3f}-{max(ratios):.3f}]" if len(ratios) > 1 else ""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wall-s", type=float, default=300.0,
                   help="seconds each configuration trains, from its first step (default 300)")
    p.add_argument("--mtbf-s", type=float, default=60.0,
                   help="mean seconds between kills (exponential; default 60)")
    p.add_argument("--seed", "--seeds", dest="seeds", type=int, nargs="+", default=[0],
                   help="the failure process's seeds: every configuration runs under each; "
                   "with several, the table pools them (default 0)")
    p.add_argument("--configs", nargs="+", type=parse_config,
                   default=[parse_config(c) for c in DEFAULT_CONFIGS],
                   help=f"fixed:N | auto, optionally +memory:M (default {DEFAULT_CONFIGS})")
    p.add_argument("--nproc", type=int, default=2, help="workers per node (default 2)")
    p.add_argument("--nodes", type=int, default=1, choices=(1, 2, 3),
                   help="agents (nodes) of the job on this machine (default 1)")
    p.add_argument("--node-loss-share", type=float, default=0.0,
                   help="with --nodes 2 or 3: the share of failures that lose the whole "
                   "node (default 0: worker kills only)")
    p.add_argument("--replace-after-s", type=float, default=0.0,
                   help="a lost node's replacement starts this long after (default 0)")
    p.add_argument("--durable-latency-s", type=float, default=0.0,
                   help="seconds every durable-storage operation waits first (a remote "
                   "store; storage.faults.latency_s); default 0: the local disk")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="the report as JSON on stdout (or to FILE)")
    p.add_argument("--workdir", default=None, help="where runs go (default: the temp dir)")
    p.add_argument("--keep", action="store_true", help="keep each run's storage and events")
    p.add_argument("--table", metavar="FILE", help="print the table of a saved --json report")
    args = p.parse_args(argv)
    if args.table:
        print(saved_tables(json.loads(Path(args.table).read_text())))
        return
    for name, value in (("--wall-s", args.wall_s), ("--mtbf-s", args.mtbf_s)):
        if value <= 0:
            raise SystemExit(f"{name}={value}: must be > 0 seconds")
    if args.node_loss_share and args.nodes == 1:
        raise SystemExit("--node-loss-share needs --nodes 2 or 3: a job of one node that "
                         "loses it has nothing left to resume")
    if not 0 <= args.durable_latency_s <= 60:
        raise SystemExit(f"--durable-latency-s={args.durable_latency_s}: must be 0-60 seconds")
    load_before = load_average()
    runs = []
    for seed in args.seeds:
        kills = failure_schedule(seed, args.mtbf_s, args.wall_s, args.nproc * args.nodes,
                                 args.node_loss_share)
        results = []
        for config in args.configs:
            results.append(run_config(config, kills, seed, args))
            if args.json is None:
                print(f"seed {seed} {config.name}: goodput {results[-1]['goodput']:.3f}",
                      file=sys.stderr)
        compare(results)
        runs.append({"seed": seed, "schedule": [{"at_s": k.at_s, "rank": k.rank,
                                                 "node": k.node} for k in kills],
                     "results": results})
    results = runs[0]["results"] if len(runs) == 1 else pool(runs)
    load_after = load_average()
    report = {"bench": "goodput", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "wall_s": args.wall_s, "mtbf_s": args.mtbf_s, "seeds": args.seeds,
              "durable_latency_s": args.durable_latency_s,
              "nproc": args.nproc, "nodes": args.nodes,
              "node_loss_share": args.node_loss_share, "replace_after_s": args.replace_after_s,
              "cpus": os.cpu_count(),
              "load_avg_before": round(load_before, 2), "load_avg_after": round(load_after, 2),
              "noisy": noisy(load_before, load_after, None) or any(r["noisy"] for r in results),
              "results": results, "runs": runs}
    if args.json is not None:
        write_json(args.json, report)
    else:
        print(table(results))
        kills_total = sum(len(run["schedule"]) for run in runs)
        print(f"{kills_total} kills scheduled (seeds {args.seeds}, MTBF {args.mtbf_s:.0f} s, "
              f"{args.wall_s:.0f} s each); load average before/after "
              f"{load_before:.2f}/{load_after:.2f}"
              + ("  (NOISY: other work was running)" if report["noisy"] else ""))


if __name__ == "__main__":
    main()
