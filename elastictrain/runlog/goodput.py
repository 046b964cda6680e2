"""Goodput: how much of a run's wall time was useful training, from its event log.

Reads rank 0's JSON-lines event files of one run (``attemptNNN-rank0.jsonl``)
and splits the wall time into:

* ``productive_s``: the steps that survive into the final model, at the
  run's median step time;
* ``lost_work_s``: steps trained and then lost to a failure (redone after a
  restart);
* ``snapshot_blocking_s``: time the training loop was blocked staging snapshots;
* ``pending_s``: gaps between launches in which no worker of the run was up:
  from the last event of one launch to the first of the next (a Slurm requeue
  waiting to be scheduled, a pod waiting for a node);
* ``restart_s``: everything else between attempts and at start-up (failure
  detection, process start, imports, rendezvous, snapshot load).

An attempt is one rank-0 event file: one torchrun restart of one launch
(``elastictrain.runlog.events`` names them), so a requeue or relaunch of the same run
counts as attempts of its own.

Step times are measured per attempt between its ``resume`` event and its last
event that names a step (``snapshot.staged``, ``run.finished``, …), so the
report needs no per-step logging.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastictrain.runlog.events import EVENTS_DIR
from elastictrain.runlog.events_read import read_event_files
from elastictrain.storage import Store

if TYPE_CHECKING:
    from elastictrain.runlog.accounting.split import Split


@dataclass(frozen=True)
class Goodput:
    """The accounting of one run; every ``_s`` field is seconds of wall time."""

    wall_s: float
    productive_s: float
    lost_work_s: float
    snapshot_blocking_s: float
    restart_s: float
    pending_s: float
    attempts: int
    final_step: int
    steps_lost: int
    step_time_s: float
    # What the figures cannot show by themselves (e.g. the node-memory tier was off).
    notes: tuple[str, ...] = ()

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "goodput": round(self.goodput, 4)}


def compute_goodput(events_dir: str | Path, store: Store | None = None) -> Goodput:
    """Account one run's wall time from the event files in ``events_dir``.

    Args:
        events_dir: a run's events directory, or with ``store`` its URL (the store
            opened at that URL, e.g. ``s3://bucket/run/events/<run id>``).

    Raises:
        FileNotFoundError: no rank-0 event files there (names the directory).
    """
    attempts = sorted((events for _, events in read_event_files(
        events_dir, "attempt*-rank0.jsonl", store) if events), key=lambda ev: ev[0]["ts"])
    if not attempts:
        raise FileNotFoundError(
            f"{events_dir}: no attempt*-rank0.jsonl event files; fix: point at a run's "
            "events directory, e.g. <storage>/events/<run id>"
        )
    start = min(e["ts"] for events in attempts for e in events)
    end = max(e["ts"] for events in attempts for e in events)
    pending = _pending_s(attempts)
    step_times: list[float] = []
    first_step: int | None = None
    final_step = 0
    lost = 0
    blocking = 0.0
    for events in attempts:
        resume = next((e for e in events if e.get("event") == "resume"), None)
        if resume is None:
            continue
        from_step = int(resume.get("from_step") or 0)
        first_step = from_step if first_step is None else first_step
        lost += int(resume.get("lost_steps") or 0)
        stepped = [e for e in events if e["ts"] >= resume["ts"] and "step" in e]
        last = max(stepped, key=lambda e: (int(e["step"]), e["ts"]))
        if int(last["step"]) > from_step:
            step_times.append((last["ts"] - resume["ts"]) / (int(last["step"]) - from_step))
        final_step = max(final_step, int(last["step"]))
        blocking += sum(float(e.get("duration_s", 0.0)) for e in events
                        if e.get("event") == "snapshot.staged")
    step_time = statistics.median(step_times) if step_times else 0.0
    wall = end - start
    productive = (final_step - (first_step or 0)) * step_time
    lost_work = lost * step_time
    restart = max(0.0, wall - productive - lost_work - blocking - pending)
    return Goodput(
        wall_s=round(wall, 3), productive_s=round(productive, 3),
        lost_work_s=round(lost_work, 3), snapshot_blocking_s=round(blocking, 3),
        restart_s=round(restart, 3), pending_s=round(pending, 3), attempts=len(attempts),
        final_step=final_step, steps_lost=lost, step_time_s=round(step_time, 5),
        notes=_memory_notes(attempts),
    )


def _memory_notes(attempts: list[list[dict[str, Any]]]) -> tuple[str, ...]:
    """How long the node-memory tier was off (``snapshot.memory_degraded`` until
    ``snapshot.memory_recovered`` or the attempt's end, e.g. a full /dev/shm): a failure
    in that time restarts from durable storage, so it loses more than with the tier."""
    off_s = 0.0
    seen: set[str] = set()
    for events in attempts:
        off: set[str] = set()
        since = 0.0
        for event in events:
            name, what, ts = event.get("event"), str(event.get("what")), float(event["ts"])
            if name == "snapshot.memory_degraded":
                seen.add(what)
                since = since if off else ts
                off.add(what)
            elif name == "snapshot.memory_recovered" and what in off:
                off.discard(what)
                off_s += 0.0 if off else ts - since
        if off:
            off_s += float(events[-1]["ts"]) - since
    if not seen:
        return ()
    return (f"the node-memory tier was off for {off_s:.1f}s ({', '.join(sorted(seen))}): "
            "a failure then restarted from durable snapshots",)


def _pending_s(attempts: list[list[dict[str, Any]]]) -> float:
    """Time between launches in which no worker of the run was up: from the last event
    of every earlier launch to the first of the next (restarts inside one launch are
    restart time, not pending)."""
    spans: dict[str, tuple[float, float]] = {}
    for events in attempts:
        launch = str(events[0].get("launch_id"))
        first, last = spans.get(launch, (events[0]["ts"], events[-1]["ts"]))
        spans[launch] = (min(first, events[0]["ts"]), max(last, events[-1]["ts"]))
    ordered = sorted(spans.values())
    pending = 0.0
    covered_until = ordered[0][1]
    for first, last in ordered[1:]:
        pending += max(0.0, first - covered_until)
        covered_until = max(covered_until, last)
    return pending


def run_events_location(location: str, store: Store | None = None) -> str:
    """The events directory of one run, from what the user passed: that directory
    itself, or a storage root (what the script gave ``SnapshotManager``, or demo/run's
    ``--storage``) whose ``events/`` holds one directory per run: the newest run's
    (by the launch ids in its file names, which sort by start time).

    Args:
        location: a local path or, with ``store`` opened at it, a URL.
    """
    def names(directory: str) -> list[str]:
        if store is None:
            path = Path(location) / directory
            return sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        try:
            return sorted(store.list_dir(directory))
        except Exception:  # a missing prefix lists nothing on most stores, raises on some
            return []

    def is_rank0(name: str) -> bool:
        return name.startswith("attempt") and name.endswith("-rank0.jsonl")

    if any(is_rank0(n) for n in names("")) or EVENTS_DIR not in names(""):
        return location
    newest: tuple[str, str] | None = None
    for run in names(EVENTS_DIR):
        launches = [n.split("-", 1)[1] for n in names(f"{EVENTS_DIR}/{run}") if is_rank0(n)]
        if launches and (newest is None or max(launches) > newest[0]):
            newest = (max(launches), run)
    if newest is None:
        return location
    return f"{location.rstrip('/')}/{EVENTS_DIR}/{newest[1]}"


def one_figure(report: Goodput, split: Split) -> dict[str, Any]:
    """``goodput --json``'s top level: the per-cause split's wall, seconds and goodput,
    so the document holds one goodput figure; the step-based estimate
    (``compute_goodput``) adds only its step time."""
    wall = split.wall_s
    productive = split.seconds["productive"]
    return {"wall_s": round(wall, 3),
            **{f"{cause}_s": round(secs, 3) for cause, secs in split.seconds.items()},
            "attempts": len(split.attempts),
            "launches": len({a.launch for a in split.attempts}),
            "final_step": split.attempts[-1].to_step,
            "steps_lost": sum(a.lost_steps for a in split.attempts),
            "step_time_s": report.step_time_s,
            "goodput": round(productive / wall, 4) if wall > 0 else 0.0,
            "notes": list(report.notes)}
