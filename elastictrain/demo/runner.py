"""``elastictrain demo``: launch the demo job under torchrun and summarise what happened.

The summary is read back from the run's event log (one JSON-lines file per
attempt and rank), the same events an operator would see.
"""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from elastictrain.errors import ConfigError
from elastictrain.launch import LaunchSpec, start_torchrun
from elastictrain.log import read_events
from elastictrain.runtime import default_events_dir
from elastictrain.config import load_settings
from elastictrain.storage import open_store


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

    def validate(self) -> None:
        """Reject bad input before any worker starts (one line: field, value, fix)."""
        if self.nproc < 1:
            raise ConfigError(f"--nproc={self.nproc}: must be >= 1")
        if self.steps < 1:
            raise ConfigError(f"--steps={self.steps}: must be >= 1")
        if self.snapshot_every < 1:
            raise ConfigError(f"--snapshot-every={self.snapshot_every}: must be >= 1")
        for step in self.kill_at:
            if not 1 <= step < self.steps:
                raise ConfigError(f"--kill-at={step}: outside the run's steps 1..{self.steps - 1}"
                                  f"; fix: choose a step below --steps={self.steps}")
        if len(set(self.kill_at)) != len(self.kill_at):
            raise ConfigError(f"--kill-at={self.kill_at}: repeated step; fix: give each once")


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_demo(opts: DemoOptions) -> DemoResult:
    """Validate, check storage, launch torchrun with restarts, and summarise."""
    opts.validate()
    settings = load_settings(storage={"url": opts.storage})
    store = open_store(opts.storage)
    store.check_writable()  # before any worker trains; raises StorageError naming the path
    run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    events_root = opts.events_dir or default_events_dir(settings) or f"./elastictrain-events"
    events_dir = str(Path(events_root) / run_id)
    Path(events_dir).mkdir(parents=True, exist_ok=True)
    worker_args = [f"--storage={opts.storage}", f"--steps={opts.steps}",
                   f"--snapshot-every={opts.snapshot_every}", f"--keep={opts.keep}",
                   f"--seed={opts.seed}", f"--events-dir={events_dir}"]
    worker_args += [f"--kill-at={k}" for k in opts.kill_at]
    spec = LaunchSpec(nproc_per_node=opts.nproc, module="elastictrain.demo.worker",
                      script_args=worker_args, max_restarts=len(opts.kill_at) + 2,
                      rdzv_id=run_id, log_dir=str(Path(events_dir) / "torchelastic"),
                      events_dir=events_dir)
    started = time.monotonic()
    with open(Path(events_dir) / "launcher.log", "w") as agent_log:
        proc = start_torchrun(spec, stdout=agent_log)
        exit_code = proc.wait()
    wall = time.monotonic() - started
    return summarize(events_dir, opts.storage, exit_code, wall)


def summarize(events_dir: str, storage: str, exit_code: int, wall_s: float) -> DemoResult:
    """Build the demo's result from rank 0's event files, one per attempt."""
    files = sorted(Path(events_dir).glob("attempt*-rank0.jsonl"))
    resumed_from: list[int | None] = []
    committed: list[int] = []
    lost = 0
    finished: dict[str, Any] = {}
    for path in files:
        for event in read_events(path):
            name = event.get("event")
            if name == "resume":
                resumed_from.append(event.get("from_step"))
                lost += int(event.get("lost_steps") or 0)
            elif name == "snapshot.committed":
                committed.append(int(event["snapshot_step"]))
            elif name == "run.finished":
                finished = event
    return DemoResult(
        final_step=finished.get("final_step"),
        restarts=max(len(files) - 1, 0),
        resumed_from=resumed_from,
        committed_steps=committed,
        lost_steps=lost,
        final_loss=finished.get("final_loss"),
        param_digest=finished.get("param_digest"),
        exit_code=exit_code,
        storage=storage,
        events_dir=events_dir,
        wall_s=round(wall_s, 2),
    )


def human_summary(result: DemoResult) -> str:
    lines = [
        f"elastictrain demo: {'finished' if result.exit_code == 0 else 'FAILED'} "
        f"in {result.wall_s:.1f}s (exit {result.exit_code})",
        f"  attempts:           {result.restarts + 1} ({result.restarts} restarts)",
        f"  resumed from steps: {', '.join('fresh' if s is None else str(s) for s in result.resumed_from)}",
        f"  snapshots committed: {', '.join(map(str, result.committed_steps)) or 'none'}",
        f"  lost steps:         {result.lost_steps}",
        f"  final step / loss:  {result.final_step} / {result.final_loss}",
        f"  param digest:       {result.param_digest}",
        f"  storage:            {result.storage}",
        f"  events:             {result.events_dir}",
    ]
    return "\n".join(lines)


def print_result(result: DemoResult, as_json: bool) -> None:
    import json

    if as_json:
        sys.stdout.write(json.dumps(result.to_dict()) + "\n")
    else:
        sys.stdout.write(human_summary(result) + "\n")
