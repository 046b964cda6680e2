"""``elastictrain status``: the state of a run started elsewhere, from its storage.

Reads the run's events (``<root>/events``, through the Store, so any backend
that holds them works) and its committed snapshots. Events of several runs may
share one events directory: the newest run is shown unless ``run_id`` is given.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any

from rich.console import Console
from rich.live import Live

from elastictrain.core.errors import ConfigError
from elastictrain.storage.api import Store
from elastictrain.storage.locations import open_from_cli
from elastictrain.view import ops
from elastictrain.view.live import REFRESH_S, render, view_wanted
from elastictrain.view.model import RunState
from elastictrain.view.tail import EventTail

FOLLOW_POLL_S = 1.0


@dataclass
class RunStatus:
    """Every run's state seen under one storage root, and its snapshots."""

    store: Store
    run_id: str | None = None
    runs: dict[str, RunState] = field(default_factory=dict)
    snapshots: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._root = "events" if "events" in self.store.list_dir("") else ""
        self._tail = EventTail(self.store, self._root)

    def poll(self) -> bool:
        """Read new events and the snapshot listing; True if anything new arrived."""
        events = self._tail.poll_with_paths()
        for path, event in events:
            self.runs.setdefault(self._run_of(path, event), RunState()).apply(event)
        self.snapshots = ops.list_snapshots(self.store)
        return bool(events)

    def _run_of(self, path: str, event: dict[str, Any]) -> str:
        """The run an event belongs to: its directory under ``events/`` (one per run: a
        launcher's own events name the id it started under, its workers' the run's;
        runlog/run_marker.py), else the run id it names."""
        parts = path.split("/")
        if self._root and len(parts) > 2:
            return parts[1]
        return str(event.get("run_id") or "unknown")

    @property
    def current(self) -> RunState | None:
        """The chosen run (``run_id``), else the one with the newest event."""
        if self.run_id is not None:
            return self.runs.get(self.run_id)
        return max(self.runs.values(), key=lambda r: r.last_ts or 0.0, default=None)

    def to_dict(self) -> dict[str, Any]:
        state = self.current
        committed = [s for s in self.snapshots if s.get("status") == ops.LISTED_COMMITTED]
        run_id = next((run for run, seen in self.runs.items() if seen is state), self.run_id)
        return {"storage": self.store.url,
                **(state.to_dict() if state else {}), "run_id": run_id,
                "runs": sorted(self.runs),
                "committed_snapshots": sorted(s["step"] for s in committed),
                "newest_snapshot": max(committed, key=lambda s: s["step"], default=None)}


def open_status(url: str, storage_options: str | None, run_id: str | None) -> RunStatus:
    """A first reading of the run at ``url``.

    Raises:
        ConfigError: nothing of a run is there (names the URL and the fix).
    """
    status = RunStatus(open_from_cli(url, storage_options), run_id)
    status.poll()
    if not status.runs and not status.snapshots:
        raise ConfigError(f"{url}: no events and no snapshots there; fix: pass a run's "
                          "storage root (the --storage of demo/run, holding events/ and "
                          "snapshots/)")
    if run_id is not None and run_id not in status.runs:
        raise ConfigError(f"--run-id={run_id}: no events of that run under {url}; runs "
                          f"there: {', '.join(sorted(status.runs)) or 'none'}")
    return status


def format_text(status: RunStatus) -> str:
    """Plain text of the status (``status`` off a terminal)."""
    data = status.to_dict()
    snap = data.get("newest_snapshot") or {}
    launches = data.get("launches") or 1
    launch = f"launch {launches} of {launches}  " if launches > 1 else ""
    lines = [f"run {data.get('run_id')}  {launch}attempt {data.get('attempt', 0)}  "
             f"world size {data.get('world_size')}  "
             f"{data.get('finished') or 'running or stopped'}",
             f"  step {data.get('step')}  per rank "
             + (", ".join(f"{r}:{s}" for r, s in (data.get("rank_steps") or {}).items())
                or "none"),
             f"  newest snapshot: step {snap['step']}, {snap.get('size_bytes')} bytes, "
             f"{snap.get('created_at')}" if snap else "  newest snapshot: none",
             *(f"  node memory tier off ({what}): {error}"
               for what, error in (data.get("memory_degraded") or {}).items()),
             *(f"  suspect snapshot, set aside: step {step}: {why}"
               for step, why in (data.get("suspects") or {}).items()),
             *(f"  {time.strftime('%H:%M:%S', time.localtime(line['ts']))} {line['text']}"
               for line in (data.get("lines") or [])[-20:])]
    return "\n".join(lines)


def show(status: RunStatus, *, json_output: bool, stream: IO[str] | None = None) -> None:
    stream = stream or sys.stdout
    if json_output:
        stream.write(json.dumps(status.to_dict()) + "\n")
    elif view_wanted(stream):
        Console(file=stream).print(_render(status))
    else:
        stream.write(format_text(status) + "\n")


def follow(status: RunStatus, *, json_output: bool, timeout_s: float | None,
           stream: IO[str] | None = None) -> bool:
    """Show the run as it goes until it ends (True) or ``timeout_s`` passes (False).

    On a terminal the status area is redrawn; otherwise each new event line is
    printed (with ``--json``, the whole state as one JSON line after each change).
    """
    stream = stream or sys.stdout
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    if view_wanted(stream, json_output=json_output):
        with Live(_render(status), console=Console(file=stream), auto_refresh=False) as live:
            return _follow_loop(status, deadline, lambda: live.update(_render(status),
                                                                      refresh=True))
    printed, shown_step = 0, -1

    def emit() -> None:
        nonlocal printed, shown_step
        state = status.current
        if json_output:
            stream.write(json.dumps(status.to_dict()) + "\n")
        elif state is not None:
            for line in list(state.lines)[printed:]:
                stamp = time.strftime("%H:%M:%S", time.localtime(line.ts))
                stream.write(f"{stamp} {line.text}\n")
            printed = len(state.lines)
            if state.step != shown_step:
                shown_step = state.step
                rate = "" if state.rate is None else f", {state.rate:.1f} steps/s"
                loss = "" if state.loss is None else f", {state.loss_text()}"
                stream.write(f"step {state.step} (attempt {state.attempt}{rate}{loss})\n")
        stream.flush()

    emit()
    return _follow_loop(status, deadline, emit)


def _follow_loop(status: RunStatus, deadline: float | None, on_change: Any) -> bool:
    poll_s = REFRESH_S if view_wanted() else FOLLOW_POLL_S
    while True:
        state = status.current
        if state is not None and state.ended:
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)  # a poll interval, not synchronisation
        if status.poll():
            on_change()


def _render(status: RunStatus) -> Any:
    state = status.current or RunState()
    run_id = status.to_dict().get("run_id") or "?"
    launches = f"  launch {state.launches} of {state.launches}" if state.launches > 1 else ""
    return render(state, f"run {run_id}{launches}")
