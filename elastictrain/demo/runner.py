"""``elastictrain demo``: launch the demo job under torchrun and summarise what happened.

The summary is read back from the run's event log (one JSON-lines file per
attempt and rank), the same events an operator would see.
"""

from __future__ import annotations

import json
import signal
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from elastictrain.core.config import load_settings
from elastictrain.core.env import LAUNCH_ID_VAR
from elastictrain.core.errors import EXIT_PREEMPTED, ConfigError
from elastictrain.demo.job import RunningJob
from elastictrain.demo.multinode import NodesPlan, membership_timings, parse_nnodes, run_nodes
from elastictrain.demo.preflight import check_resumable, validate_elastic
from elastictrain.launcher.spawn import LaunchSpec, start_torchrun
from elastictrain.runlog import events
from elastictrain.runlog.events_read import read_events
from elastictrain.runlog.failure import failure_lines
from elastictrain.runlog.launches import in_launch
from elastictrain.runlog.run_marker import storage_run_id
from elastictrain.storage import open_store
from elastictrain.view.live import LiveView, live_view
from elastictrain.view.model import attempts_text


@dataclass
class DemoOptions:
    storage: str = "./elastictrain-demo"
    nproc: int = 2
    steps: int = 300
    snapshot_every: int = 25
    keep: int = 3
    kill_at: list[int] = field(default_factory=list)
    seed: int = 0
    events_dir: str | None = None
    nnodes: str = "1"
    kill_node_at: int | None = None
    add_node_at: int | None = None
    batch_size: int = 16
    global_batch_size: int | None = None
    samples: int | None = None
    record_samples: str | None = None
    live: bool = False  # the live terminal view (elastictrain.view.live)
    # fsspec storage_options (may hold credentials): never printed, never on a command line.
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)

    def validate(self) -> None:
        """Reject bad input before any worker starts (one line: field, value, fix)."""
        if not self.storage:
            raise ConfigError("--storage='': empty; fix: a directory or URL (s3://bucket/run)")
        for flag, path in (("--events-dir", self.events_dir),
                           ("--record-samples", self.record_samples)):
            if path is not None and Path(path).exists() and not Path(path).is_dir():
                raise ConfigError(f"{flag}={path}: is a file; fix: name a directory")
        if self.nproc < 1:
            raise ConfigError(f"--nproc={self.nproc}: must be >= 1")
        if self.steps < 1:
            raise ConfigError(f"--steps={self.steps}: must be >= 1")
        if self.snapshot_every < 1:
            raise ConfigError(f"--snapshot-every={self.snapshot_every}: must be >= 1")
        if self.keep < 1:
            raise ConfigError(f"--keep={self.keep}: must be >= 1 (the newest snapshot is "
                              "what a restart resumes from)")
        for step in self.kill_at:
            if not 1 <= step < self.steps:
                raise ConfigError(f"--kill-at={step}: outside the run's steps 1..{self.steps - 1}"
                                  f"; fix: choose a step below --steps={self.steps}")
        if len(set(self.kill_at)) != len(self.kill_at):
            raise ConfigError(f"--kill-at={self.kill_at}: repeated step; fix: give each once")
        validate_elastic(self)


@dataclass
class DemoResult:
    final_step: int | None
    restarts: int
    resumed_from: list[int | None]
    committed_steps: list[int]
    lost_steps: int
    final_loss: float | None
    param_digest: str | None
    exit_code: int
    storage: str
    events_dir: str
    wall_s: float
    world_sizes: list[int] = field(default_factory=list)  # one per attempt
    membership: list[dict[str, Any]] = field(default_factory=list)  # nodes killed / added
    final_snapshot: int | None = None  # step of the final snapshot after a notice
    interrupted: str | None = None  # SIGINT / SIGTERM the demo received
    # The first failing worker's error of the last failed attempt (elastictrain.runlog.failure),
    # and the number of identical failures when the launcher stopped on a crash loop.
    error: dict[str, Any] | None = None
    crash_loop: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_demo(opts: DemoOptions,
             on_start: Callable[[RunningJob], None] | None = None) -> DemoResult:
    """Validate, check storage, launch torchrun with restarts, wait, and summarise.

    Args:
        opts: the demo's options.
        on_start: called once the launcher runs (e.g. a live view of
            ``job.events_dir``); the wait routes Ctrl-C/SIGTERM to the job
            (see elastictrain.demo.job).
    """
    opts.validate()
    storage: dict[str, Any] = {"url": opts.storage}
    if opts.storage_options:
        storage["storage_options"] = opts.storage_options
    settings = load_settings(storage=storage)
    store = open_store(settings.storage)
    store.check_writable()  # before any worker trains; raises StorageError naming the path
    check_resumable(opts, store)  # dataset length vs the newest snapshot, before training
    # The storage's run: a relaunch of the demo on it continues that run's events.
    run_id = storage_run_id(store, f"demo-{time.strftime('%Y%m%d-%H%M%S')}-"
                                   f"{uuid.uuid4().hex[:6]}")
    events_root = opts.events_dir or events.events_root(settings) or "./elastictrain-events"
    events_dir = str(Path(events_root) / run_id)
    Path(events_dir).mkdir(parents=True, exist_ok=True)
    worker_args = [f"--storage={opts.storage}", f"--steps={opts.steps}",
                   f"--snapshot-every={opts.snapshot_every}", f"--keep={opts.keep}",
                   f"--seed={opts.seed}", f"--events-dir={events_dir}"]
    worker_args += [f"--kill-at={k}" for k in opts.kill_at]
    worker_args += elastic_worker_args(opts)
    if parse_nnodes(opts.nnodes)[1] > 1:
        return run_multinode_demo(opts, run_id, events_dir, worker_args)
    # Named here: the view and the summary show this launch, not the run's earlier ones,
    # and its logs do not overwrite theirs.
    launch = events.new_launch_id()
    spec = LaunchSpec(nproc_per_node=opts.nproc, module="elastictrain.demo.worker",
                      script_args=worker_args, max_restarts=len(opts.kill_at) + 2,
                      rdzv_id=run_id, log_dir=str(Path(events_dir) / "torchelastic" / launch),
                      events_dir=events_dir)
    started = time.monotonic()
    with open(Path(events_dir) / f"launcher-{launch}.log", "w") as agent_log:
        job = RunningJob(events_dir, [start_torchrun(
            spec, stdout=agent_log, extra_env={**_worker_env(opts), LAUNCH_ID_VAR: launch})])
        if on_start is not None:
            on_start(job)
        with _live_view(opts, run_id, events_dir, launch) as view:
            if view is not None:
                job.announce = view.note
            exit_code = job.wait()
    return _with_interrupt(summarize(events_dir, store.url, exit_code,
                                     time.monotonic() - started, launch), job)


def _with_interrupt(result: DemoResult, job: RunningJob) -> DemoResult:
    """What a SIGINT/SIGTERM to the demo did, in its result."""
    if job.interrupted is not None:
        result.interrupted = job.interrupted
        if job.forced:  # as if the signal had killed the demo
            result.exit_code = 128 + int(signal.Signals[job.interrupted])
    return result


def _live_view(opts: DemoOptions, run_id: str, events_dir: str, launch: str | None
               ) -> AbstractContextManager[LiveView | None]:
    """The live view of launch ``launch`` of this run while the job runs (when
    ``opts.live``)."""
    return live_view(enabled=opts.live, store=open_store(events_dir), root="",
                     title=f"elastictrain demo {run_id}", total_steps=opts.steps,
                     footer="Ctrl-C stops the job", launch=launch)


def _worker_env(opts: DemoOptions) -> dict[str, str]:
    """Storage options reach the workers through their environment, never their
    arguments: torchrun logs a worker's command line. The URL is there too, so the
    agent's events reach the run's storage (elastictrain.runlog.events)."""
    env = {"ELASTICTRAIN_STORAGE__URL": opts.storage}
    if opts.storage_options:
        env["ELASTICTRAIN_STORAGE__STORAGE_OPTIONS"] = json.dumps(opts.storage_options)
    return env


def elastic_worker_args(opts: DemoOptions) -> list[str]:
    """Worker options of the elastic features, passed only when set."""
    args = [f"--batch-size={opts.batch_size}"]
    if opts.global_batch_size is not None:
        args.append(f"--global-batch-size={opts.global_batch_size}")
    if opts.samples is not None:
        args.append(f"--samples={opts.samples}")
    if opts.record_samples is not None:
        args.append(f"--record-samples={Path(opts.record_samples).resolve()}")
    return args


def run_multinode_demo(opts: DemoOptions, run_id: str, events_dir: str,
                       worker_args: list[str]) -> DemoResult:
    """Several agents on this machine (see elastictrain.demo.multinode)."""
    plan = NodesPlan(nnodes=opts.nnodes, nproc=opts.nproc, kill_node_at=opts.kill_node_at,
                     add_node_at=opts.add_node_at, worker_args=worker_args, run_id=run_id,
                     events_dir=Path(events_dir), launch=events.new_launch_id())
    started = time.monotonic()
    job = RunningJob(events_dir, [])
    with _live_view(opts, run_id, events_dir, plan.launch) as view:
        if view is not None:
            job.announce = view.note
        exit_code = run_nodes(plan, job)
    result = summarize(events_dir, opts.storage, exit_code, time.monotonic() - started,
                       plan.launch)
    result.membership = membership_timings(plan.membership, events_dir)
    return _with_interrupt(result, job)


def summarize(events_dir: str, storage: str, exit_code: int, wall_s: float,
              launch: str | None = None) -> DemoResult:
    """Build the demo's result from rank 0's event files (one per attempt; several
    nodes each have a directory of them), in time order: those of launch ``launch``
    when given (the run's earlier launches on the same storage share the directory;
    ``status`` and ``goodput`` cover them all)."""
    def ours(event: dict[str, Any]) -> bool:
        return launch is None or in_launch(event.get("launch_id"), launch)

    files = sorted(Path(events_dir).rglob("attempt*-rank0.jsonl"))
    resumed_from: list[int | None] = []
    world_sizes: list[int] = []
    committed: list[int] = []
    lost = 0
    finished: dict[str, Any] = {}
    final_snapshot: int | None = None
    for event in sorted((e for p in files for e in read_events(p) if ours(e)),
                        key=lambda e: e["ts"]):
        name = event.get("event")
        if name == "resume":
            resumed_from.append(event.get("from_step"))
            world_sizes.append(int(event["world_size"]))
            lost += int(event.get("lost_steps") or 0)
        elif name == "snapshot.committed":
            committed.append(int(event["snapshot_step"]))
        elif name == "run.finished":
            finished = event
        elif name == "preempt.saved":
            final_snapshot = int(event["snapshot_step"])
    error: dict[str, Any] | None = None
    crash_loop: int | None = None
    agent_files = sorted(Path(events_dir).rglob("agent-*.jsonl"))
    for event in sorted((e for p in agent_files for e in read_events(p) if ours(e)),
                        key=lambda e: e["ts"]):
        if event.get("event") == "agent.worker_failed" and event.get("first"):
            error = event
        elif event.get("event") == "agent.crash_loop":
            crash_loop = int(event.get("failures") or 0)
    return DemoResult(
        final_step=finished.get("final_step"),
        restarts=max(len(resumed_from) - 1, 0),
        resumed_from=resumed_from,
        committed_steps=committed,
        lost_steps=lost,
        final_loss=finished.get("final_loss"),
        param_digest=finished.get("param_digest"),
        exit_code=exit_code,
        storage=storage,
        events_dir=events_dir,
        wall_s=round(wall_s, 2),
        world_sizes=world_sizes,
        final_snapshot=final_snapshot,
        error=error if exit_code != 0 else None,
        crash_loop=crash_loop,
    )


def human_summary(result: DemoResult) -> str:
    lines = [
        _first_line(result),
        f"  attempts:           {attempts_text(result.restarts)}",
        f"  resumed from steps: {_steps(result.resumed_from)}",
        f"  world sizes:        {', '.join(map(str, result.world_sizes))}",
        *(f"  {m['change']}:{' ' * (18 - len(m['change']))}node {m['node']} after step "
          f"{m['after_step']}, first step at world size {m.get('world_size')} "
          f"{m.get('seconds_to_first_step')}s later" for m in result.membership),
        f"  snapshots committed: {', '.join(map(str, result.committed_steps)) or 'none'}",
        f"  lost steps:         {result.lost_steps}",
        f"  final step / loss:  {_known(result.final_step)} / {_known(result.final_loss)}",
        f"  param digest:       {result.param_digest}",
        f"  storage:            {result.storage}",
        f"  events:             {result.events_dir}",
    ]
    if result.exit_code not in (0, EXIT_PREEMPTED):
        lines += failure_lines(result.error, result.crash_loop)
    return "\n".join(lines)


def _first_line(result: DemoResult) -> str:
    took = f"{result.wall_s:.1f}s"
    if result.interrupted is None:  # "finished in 12.3s (exit 0)": CI reads this form
        return f"elastictrain demo: {_outcome(result)} in {took} (exit {result.exit_code})"
    # Interrupted: the time first, so that it does not read as a wait before resuming.
    return f"elastictrain demo: after {took}, exit {result.exit_code}: {_outcome(result)}"


def _known(value: object) -> str:
    return "unknown" if value is None else str(value)


def _outcome(result: DemoResult) -> str:
    if result.interrupted is None:
        return "finished" if result.exit_code == 0 else "FAILED"
    if result.final_snapshot is not None:  # committed, as the view said, whatever came next
        stopped = "" if result.exit_code == EXIT_PREEMPTED else ", then the job was killed"
        return (f"interrupted ({result.interrupted}): final snapshot at step "
                f"{result.final_snapshot} committed{stopped}; resume with the same command")
    newest = max(result.committed_steps, default=None)
    return (f"interrupted ({result.interrupted}): no final snapshot; a re-run resumes from "
            f"{'step ' + str(newest) if newest is not None else 'the start'}")


def _steps(steps: list[int | None]) -> str:
    return ", ".join("fresh" if s is None else str(s) for s in steps)


def print_result(result: DemoResult, *, as_json: bool) -> None:
    import json

    if as_json:
        sys.stdout.write(json.dumps(result.to_dict()) + "\n")
    else:
        sys.stdout.write(human_summary(result) + "\n")
